// treeverify's binaries document their flags with dashes (--world-size), as command-line tools
// usually do; Abseil names flags with underscores (world_size). NormalizeFlagNames turns the
// dashes inside a flag's name into underscores before absl::ParseCommandLine, so both
// spellings work. Values are left alone (--model=/data/my-model), and so is everything after
// a bare "--".
//
//   FlagArgs args(argc, argv);
//   absl::ParseCommandLine(args.argc(), args.argv());
#pragma once

#include <string>
#include <vector>

namespace treeverify::services {

std::vector<std::string> NormalizeFlagNames(int argc, char** argv);

// The normalized arguments in the argc/argv form that absl::ParseCommandLine takes. Keep it
// alive while the parsed arguments are used.
class FlagArgs {
 public:
  FlagArgs(int argc, char** argv);
  FlagArgs(const FlagArgs&) = delete;
  FlagArgs& operator=(const FlagArgs&) = delete;

  int argc() const { return static_cast<int>(pointers_.size()); }
  char** argv() { return pointers_.data(); }

 private:
  std::vector<std::string> args_;
  std::vector<char*> pointers_;
};

}  // namespace treeverify::services
