// The shared shape of treeverify's server mains: parse flags (dashes or underscores), block the
// termination signals before any other thread exists, run, and turn the result into an exit
// status with a message.
//
//   int main(int argc, char** argv) {
//     return treeverify::services::ProcessMain(argc, argv, "treeverify-worker", kUsage, Run);
//   }
#pragma once

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "treeverify/services/signal_waiter.h"

namespace treeverify::services {

// 0 when run returns OK, 1 with the status on stderr otherwise, 2 for unexpected arguments.
int ProcessMain(int argc, char** argv, const char* program, const char* usage,
                absl::FunctionRef<absl::Status(SignalWaiter&)> run);

}  // namespace treeverify::services
