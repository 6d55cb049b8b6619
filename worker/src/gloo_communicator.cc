#include "treeverify/worker/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "treeverify/kernels/status.h"

namespace treeverify::worker {
namespace {

// Gloo's TCP transport writes with writev(2): a write to a peer that has gone away raises
// SIGPIPE, whose default action kills the process. A lost peer must be an error Status instead,
// so a process that forms a Gloo group ignores SIGPIPE, unless it installed its own handler.
void IgnoreSigpipeUnlessHandled() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && !(current.sa_flags & SA_SIGINFO) &&
        current.sa_handler == SIG_DFL) {
      std::signal(SIGPIPE, SIG_IGN);
    }
  });
}

// Gloo reports every failure as an exception whose message is all there is to go on; its
// timeouts say "timeout" or "Timed out".
absl::Status StatusFromGlooException(absl::string_view context, absl::string_view what) {
  const std::string message = absl::StrCat(context, ": ", what);
  if (absl::StrContains(absl::AsciiStrToLower(what), "timeout") ||
      absl::StrContains(absl::AsciiStrToLower(what), "timed out")) {
    return absl::DeadlineExceededError(message);
  }
  return absl::UnavailableError(message);
}

// The numeric addresses (IPv4 or IPv6) that `host` resolves to, in getaddrinfo's order.
// Gloo 0.5.0 resolves host names itself but checks getaddrinfo's result against -1 only, while
// its errors are other negative codes: an unresolvable name makes it dereference an
// uninitialized pointer and crash. So names are resolved here, and Gloo only sees numeric
// addresses, which always resolve.
absl::StatusOr<std::vector<std::string>> ResolveNumeric(const std::string& host) {
  struct addrinfo hints {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* result = nullptr;
  const int rv = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (rv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot resolve GlooOptions.interface_address \"", host, "\": ", gai_strerror(rv)));
  }
  std::vector<std::string> numeric;
  for (const struct addrinfo* entry = result; entry != nullptr; entry = entry->ai_next) {
    std::array<char, NI_MAXHOST> text{};
    if (getnameinfo(entry->ai_addr, entry->ai_addrlen, text.data(), text.size(), nullptr, 0,
                    NI_NUMERICHOST) == 0) {
      numeric.emplace_back(text.data());
    }
  }
  freeaddrinfo(result);
  if (numeric.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GlooOptions.interface_address \"", host, "\" resolves to no usable address"));
  }
  return numeric;
}

// A TCP device listening on the first of `host`'s addresses that can be bound.
absl::StatusOr<std::shared_ptr<gloo::transport::Device>> CreateTcpDevice(const std::string& host) {
  TV_ASSIGN_OR_RETURN(const std::vector<std::string> addresses, ResolveNumeric(host));
  std::string errors;
  for (const std::string& address : addresses) {
    try {
      gloo::transport::tcp::attr attr;
      attr.hostname = address;
      return gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", address, ": ", e.what());
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "cannot bind a TCP device to GlooOptions.interface_address \"", host, "\": ", errors));
}

std::chrono::milliseconds ToGlooTimeout(absl::Duration timeout) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout));
}

// Gloo's rendezvous talks to a gloo::rendezvous::Store; this one forwards to a RendezvousStore
// under the group's key prefix. Every wait is bounded by one deadline for the whole rendezvous,
// and get() waits too: Gloo 0.5.0 reads some keys ("rank_<i>") without waiting for them first.
// A store error is kept as a Status (Gloo only carries the exception's text) and thrown as
// gloo::IoException to unwind Gloo.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(RendezvousStore* store, std::string key_prefix, absl::Time deadline)
      : store_(store), key_prefix_(std::move(key_prefix)), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    const absl::Status status =
        store_->Set(key_prefix_ + key, std::string(data.begin(), data.end()));
    if (!status.ok()) Fail(status);
  }

  std::vector<char> get(const std::string& key) override {
    auto cached = fetched_.find(key);
    if (cached == fetched_.end()) {
      Fetch({key}, absl::InfiniteDuration());
      cached = fetched_.find(key);
    }
    return std::vector<char>(cached->second.begin(), cached->second.end());
  }

  void wait(const std::vector<std::string>& keys) override {
    Fetch(keys, absl::InfiniteDuration());
  }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    // Gloo's kNoTimeout (zero) means "no timeout of its own"; the deadline still applies.
    Fetch(keys, timeout.count() > 0 ? absl::FromChrono(timeout) : absl::InfiniteDuration());
  }

  // The store's own error, when the rendezvous failed because of it.
  const absl::Status& error() const { return error_; }

 private:
  // Waits for the keys and keeps their values: Gloo waits for a key and then gets it, and over
  // gRPC that would be two round trips.
  void Fetch(const std::vector<std::string>& keys, absl::Duration timeout) {
    std::vector<std::string> prefixed;
    prefixed.reserve(keys.size());
    for (const std::string& key : keys) prefixed.push_back(key_prefix_ + key);
    const absl::Duration remaining = std::max(deadline_ - absl::Now(), absl::ZeroDuration());
    absl::StatusOr<std::vector<std::string>> values =
        store_->Get(prefixed, std::min(timeout, remaining));
    if (!values.ok()) Fail(values.status());
    if (values->size() != keys.size()) {
      Fail(absl::InternalError(absl::StrCat("the rendezvous store returned ", values->size(),
                                            " values for ", keys.size(), " keys")));
    }
    for (size_t i = 0; i < keys.size(); ++i) fetched_[keys[i]] = std::move((*values)[i]);
  }

  [[noreturn]] void Fail(absl::Status status) {
    error_ = std::move(status);
    throw gloo::IoException(std::string(error_.message()));
  }

  RendezvousStore* store_;
  const std::string key_prefix_;
  const absl::Time deadline_;
  std::map<std::string, std::string> fetched_;  // by unprefixed key
  absl::Status error_;
};

}  // namespace

absl::Status GlooOptions::Validate() const {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("GlooOptions.world_size must be at least 1, got ", world_size));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("GlooOptions.rank must be in [0, ", world_size, "), got ", rank));
  }
  // Gloo counts in whole milliseconds; an infinite timeout would let a lost peer hang the rank.
  if (timeout < absl::Milliseconds(1) || timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GlooOptions.timeout must be finite and at least 1ms, got ",
                     absl::FormatDuration(timeout)));
  }
  if (world_size > 1 && interface_address.empty()) {
    return absl::InvalidArgumentError(
        "GlooOptions.interface_address must name the address to bind, e.g. 127.0.0.1");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    const GlooOptions& options, RendezvousStore* store) {
  TV_RETURN_IF_ERROR(options.Validate());
  if (options.world_size == 1) {
    return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(options, nullptr));
  }
  if (store == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GlooCommunicator: a group of ", options.world_size, " ranks needs a rendezvous store"));
  }
  IgnoreSigpipeUnlessHandled();
  const std::string who = absl::StrCat("rank ", options.rank, " of ", options.world_size,
                                       " (key prefix \"", options.key_prefix, "\")");

  absl::StatusOr<std::shared_ptr<gloo::transport::Device>> device =
      CreateTcpDevice(options.interface_address);
  if (!device.ok()) {
    return absl::Status(device.status().code(),
                        absl::StrCat("Gloo: ", who, ": ", device.status().message()));
  }

  StoreAdapter adapter(store, options.key_prefix, absl::Now() + options.timeout);
  auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
  try {
    context->setTimeout(ToGlooTimeout(options.timeout));
    context->connectFullMesh(adapter, *device);
  } catch (const std::exception& e) {
    if (!adapter.error().ok()) {
      return absl::Status(adapter.error().code(),
                          absl::StrCat("Gloo: ", who, " could not form the group through the ",
                                       "rendezvous store: ", adapter.error().message()));
    }
    return StatusFromGlooException(absl::StrCat("Gloo: ", who, " could not connect to its peers"),
                                   e.what());
  } catch (...) {
    return absl::UnavailableError(
        absl::StrCat("Gloo: ", who, " could not connect to its peers (unknown exception)"));
  }
  return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(options, std::move(context)));
}

GlooCommunicator::GlooCommunicator(const GlooOptions& options,
                                   std::shared_ptr<gloo::Context> context)
    : options_(options), context_(std::move(context)) {}

GlooCommunicator::~GlooCommunicator() = default;

absl::Status GlooCommunicator::AllReduceSum(absl::Span<float> data) {
  if (!failure_.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "the Gloo group (key prefix \"", options_.key_prefix,
        "\") is broken by an earlier failure; form a new group: ", failure_.message()));
  }
  const size_t length = data.size();
  const int world = options_.world_size;
  if (world == 1 || length == 0) return absl::OkStatus();

  gathered_.resize(length * world);
  try {
    gloo::AllgatherOptions allgather(context_);
    allgather.setInput(data.data(), length);
    allgather.setOutput(gathered_.data(), gathered_.size());
    // Gloo matches messages by slot, built from the tag. With the length as the tag, ranks that
    // pass different lengths never exchange data and time out; with equal tags the receiving
    // side's event loop would hit a GLOO_ENFORCE on the size and terminate the process.
    allgather.setTag(static_cast<uint32_t>(length));
    allgather.setTimeout(ToGlooTimeout(options_.timeout));
    gloo::allgather(allgather);
  } catch (const std::exception& e) {
    failure_ = StatusFromGlooException(
        absl::StrCat("Gloo AllReduceSum of ", length, " floats on rank ", options_.rank, " of ",
                     world, " (key prefix \"", options_.key_prefix, "\")"),
        e.what());
    return failure_;
  } catch (...) {
    failure_ = absl::UnavailableError(absl::StrCat(
        "Gloo AllReduceSum of ", length, " floats on rank ", options_.rank, ": unknown exception"));
    return failure_;
  }

  // Rank order, element by element, exactly as InProcessGroup: ((b0[i] + b1[i]) + b2[i]) + ...
  std::copy(gathered_.begin(), gathered_.begin() + length, data.begin());
  for (int other = 1; other < world; ++other) {
    const float* addend = gathered_.data() + static_cast<size_t>(other) * length;
    for (size_t i = 0; i < length; ++i) data[i] += addend[i];
  }
  return absl::OkStatus();
}

}  // namespace treeverify::worker
