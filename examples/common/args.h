#pragma once
// A small command-line flag parser for the examples: --name value or --name=value, typed
// getters with defaults, --help text generated from the declarations, and a one-line error
// (ArgsError) for an unknown flag, a missing value or a value that does not parse.
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem::examples {

// The whole number v spells, in base 10 and in range, else nothing: an empty string, trailing
// characters or an overflow. Args::integer and the list flags parse with it.
std::optional<int64_t> parse_integer(const std::string& v);

class ArgsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Args {
 public:
  Args(std::string program, std::string summary) : program_(std::move(program)), summary_(std::move(summary)) {}

  // Declarations (before parse). A flag without a value is a switch (bool).
  void option(const std::string& name, const std::string& default_value, const std::string& help);
  void flag(const std::string& name, const std::string& help);
  // A flag whose value may be left out: "--name V" or "--name=V", or "--name" alone (followed
  // by nothing or by another flag), which gives it the value "" -- given() tells the two
  // apart from not giving the flag.
  void optional_value(const std::string& name, const std::string& help);

  // Parses argv; returns false when --help was given (help() has the text).
  bool parse(int argc, char** argv);
  std::string help() const;

  std::string str(const std::string& name) const;
  int64_t integer(const std::string& name, int64_t min = INT64_MIN, int64_t max = INT64_MAX) const;
  double real(const std::string& name, double min = -1e300, double max = 1e300) const;
  bool on(const std::string& name) const;
  // One of the listed choices, else ArgsError naming the flag, the value and the choices.
  std::string choice(const std::string& name, const std::vector<std::string>& choices) const;
  bool given(const std::string& name) const { return given_.count(name) > 0; }

 private:
  struct Spec {
    std::string default_value, help;
    bool is_flag = false;
    bool value_optional = false;
  };
  const Spec& spec(const std::string& name) const;
  std::string program_, summary_;
  std::vector<std::string> order_;
  std::map<std::string, Spec> specs_;
  std::map<std::string, std::string> given_;
};

}  // namespace tandem::examples
