#include "treeverify/services/process_main.h"

#include <cstdio>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "treeverify/services/flag_names.h"

namespace treeverify::services {

int ProcessMain(int argc, char** argv, const char* program, const char* usage,
                absl::FunctionRef<absl::Status(SignalWaiter&)> run) {
  FlagArgs args(argc, argv);
  absl::SetProgramUsageMessage(usage);
  std::vector<char*> positional = absl::ParseCommandLine(args.argc(), args.argv());
  if (positional.size() != 1) {
    std::fprintf(stderr, "%s: unexpected argument '%s'\n", program, positional[1]);
    return 2;
  }
  // Before any other thread exists: every thread inherits the blocked signals.
  SignalWaiter signals;
  absl::Status status = run(signals);
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, status.ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "%s: stopped\n", program);
  return 0;
}

}  // namespace treeverify::services
