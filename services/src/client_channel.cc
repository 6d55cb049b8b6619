#include "treeverify/services/client_channel.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace treeverify::services {

absl::Status ValidateMaxMessageBytes(int64_t bytes) {
  if (bytes < 1024 || bytes > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("max message size must be in [1024, ",
                                                   std::numeric_limits<int>::max(), "] bytes, got ",
                                                   bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateClientChannel(const std::string& address,
                                                                   int64_t max_message_bytes) {
  if (address.empty()) return absl::InvalidArgumentError("the server address must be host:port");
  if (absl::Status status = ValidateMaxMessageBytes(max_message_bytes); !status.ok()) {
    return status;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

absl::Status WaitForChannel(grpc::Channel& channel, absl::string_view address,
                            absl::Duration timeout) {
  const absl::Time deadline =
      timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  // WaitForConnected takes a finite deadline: wait in slices when there is none.
  while (true) {
    const absl::Time slice_end = std::min(deadline, absl::Now() + absl::Seconds(1));
    if (channel.WaitForConnected(absl::ToChronoTime(slice_end))) return absl::OkStatus();
    if (absl::Now() >= deadline) break;
  }
  return absl::UnavailableError(
      absl::StrCat("could not connect to ", address, " within ", absl::FormatDuration(timeout)));
}

void SetTimeout(grpc::ClientContext& context, absl::Duration timeout) {
  if (timeout == absl::InfiniteDuration()) return;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace treeverify::services
