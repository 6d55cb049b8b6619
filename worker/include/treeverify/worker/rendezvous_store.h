// The key/value store through which the ranks of a collective group find each other: each rank
// publishes its addresses under its own keys and waits for its peers' keys. The coordinator hosts
// the store (services/ serves it over gRPC against this interface); a group epoch is a key prefix
// chosen by the caller ("epoch/3/"), so a re-formed group never reads a dead group's keys.
//
// Keys are write-once: Set on an existing key succeeds when the value is the same (a retried Set
// is harmless) and is ALREADY_EXISTS otherwise (two processes claiming one rank of one epoch, or
// an epoch reused).
//
//   InMemoryRendezvousStore store;
//   TV_RETURN_IF_ERROR(store.Set("epoch/1/rank0", address));
//   TV_ASSIGN_OR_RETURN(std::vector<std::string> values,
//                       store.Get({"epoch/1/rank1"}, absl::Seconds(30)));
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace treeverify::worker {

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  // ALREADY_EXISTS when the key holds a different value.
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits until every key exists, then returns their values in the order of `keys`.
  // DEADLINE_EXCEEDED (naming the missing keys) when they do not all exist within `timeout`.
  virtual absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                                       absl::Duration timeout) = 0;
};

// The store in one process's memory: for tests (ranks as threads) and for the coordinator, which
// serves it to the worker processes. Thread safe.
class InMemoryRendezvousStore final : public RendezvousStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto [it, inserted] = values_.emplace(key, value);
      if (!inserted && it->second != value) {
        return absl::AlreadyExistsError(absl::StrCat(
            "rendezvous key \"", key, "\" is already set to a different value (keys are written ",
            "once: is another process using the same rank and group epoch?)"));
      }
    }
    key_added_.notify_all();
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                               absl::Duration timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto all_present = [&] {
      for (const std::string& key : keys) {
        if (!values_.contains(key)) return false;
      }
      return true;
    };
    // Beyond a year counts as forever; it also keeps steady_clock arithmetic from overflowing.
    if (timeout > absl::Hours(24 * 365)) {
      key_added_.wait(lock, all_present);
    } else {
      const auto deadline = std::chrono::steady_clock::now() +
                            absl::ToChronoNanoseconds(std::max(timeout, absl::ZeroDuration()));
      if (!key_added_.wait_until(lock, deadline, all_present)) {
        std::vector<std::string> missing;
        for (const std::string& key : keys) {
          if (!values_.contains(key)) missing.push_back(key);
        }
        return absl::DeadlineExceededError(absl::StrCat("rendezvous keys still missing after ",
                                                        absl::FormatDuration(timeout), ": ",
                                                        absl::StrJoin(missing, ", ")));
      }
    }
    std::vector<std::string> values;
    values.reserve(keys.size());
    for (const std::string& key : keys) values.push_back(values_.at(key));
    return values;
  }

  // Drops every key that starts with `prefix` (a finished group epoch); returns how many.
  size_t ErasePrefix(absl::string_view prefix) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t erased = 0;
    auto it = values_.lower_bound(std::string(prefix));
    while (it != values_.end() && absl::string_view(it->first).substr(0, prefix.size()) == prefix) {
      it = values_.erase(it);
      ++erased;
    }
    return erased;
  }

 private:
  std::mutex mutex_;
  std::condition_variable key_added_;
  std::map<std::string, std::string> values_;  // ordered, so ErasePrefix is a range erase
};

}  // namespace treeverify::worker
