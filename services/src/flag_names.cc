#include "treeverify/services/flag_names.h"

#include <algorithm>

namespace treeverify::services {

std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--") break;  // the rest are positional arguments
    if (arg.size() < 3 || arg[0] != '-') continue;
    const size_t name_begin = arg[1] == '-' ? 2 : 1;
    const size_t name_end = std::min(arg.find('='), arg.size());
    for (size_t c = name_begin; c < name_end; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  return args;
}

FlagArgs::FlagArgs(int argc, char** argv) : args_(NormalizeFlagNames(argc, argv)) {
  for (std::string& arg : args_) pointers_.push_back(arg.data());
}

}  // namespace treeverify::services
