#pragma once
// The command-line checks of the bench programs: a bad argument is one line naming the program
// and the argument, and exit 2.
#include <cstdio>
#include <cstdlib>
#include <string>

namespace tandem::bench {

[[noreturn]] inline void usage(const char* program, const std::string& why) {
  std::fprintf(stderr, "%s: %s\n", program, why.c_str());
  std::exit(2);
}

// The value of `flag`, which must be a positive integer.
inline long positive(const char* program, const std::string& flag, const char* value) {
  char* end = nullptr;
  const long v = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || v < 1)
    usage(program, flag + " " + value + " is not a positive integer");
  return v;
}

}  // namespace tandem::bench
