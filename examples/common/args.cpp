#include "common/args.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace tandem::examples {

void Args::option(const std::string& name, const std::string& default_value, const std::string& help) {
  order_.push_back(name);
  specs_[name] = Spec{default_value, help, false};
}

void Args::flag(const std::string& name, const std::string& help) {
  order_.push_back(name);
  specs_[name] = Spec{"", help, true};
}

void Args::optional_value(const std::string& name, const std::string& help) {
  order_.push_back(name);
  specs_[name] = Spec{"", help, false, true};
}

const Args::Spec& Args::spec(const std::string& name) const {
  auto it = specs_.find(name);
  if (it == specs_.end()) throw ArgsError("internal: undeclared flag --" + name);
  return it->second;
}

bool Args::parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") return false;
    if (a.rfind("--", 0) != 0) throw ArgsError("unexpected argument '" + a + "' (flags start with --; see --help)");
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = specs_.find(name);
    if (it == specs_.end()) throw ArgsError("unknown flag --" + name + " (see --help)");
    if (it->second.is_flag) {
      if (has_value) throw ArgsError("flag --" + name + " takes no value");
      given_[name] = "1";
      continue;
    }
    if (!has_value && it->second.value_optional) {
      const bool next_is_value = i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0;
      given_[name] = next_is_value ? argv[++i] : "";
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc) throw ArgsError("flag --" + name + " needs a value");
      value = argv[++i];
    }
    given_[name] = value;
  }
  return true;
}

std::string Args::help() const {
  std::ostringstream os;
  os << "usage: " << program_ << " [flags]\n" << summary_ << "\n\nflags:\n";
  for (const auto& name : order_) {
    const Spec& s = specs_.at(name);
    std::string left = "  --" + name + (s.is_flag ? "" : s.value_optional ? " [V]" : " V");
    os << left << std::string(left.size() < 24 ? 24 - left.size() : 1, ' ') << s.help;
    if (!s.is_flag && !s.default_value.empty()) os << " (default: " << s.default_value << ")";
    os << "\n";
  }
  os << "  --help                show this text\n";
  return os.str();
}

std::string Args::str(const std::string& name) const {
  const Spec& s = spec(name);
  auto it = given_.find(name);
  return it == given_.end() ? s.default_value : it->second;
}

std::optional<int64_t> parse_integer(const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0) return std::nullopt;
  return x;
}

int64_t Args::integer(const std::string& name, int64_t min, int64_t max) const {
  std::string v = str(name);
  const std::optional<int64_t> parsed = parse_integer(v);
  if (!parsed) throw ArgsError("--" + name + ": '" + v + "' is not an integer");
  const int64_t x = *parsed;
  if (x < min || x > max)
    throw ArgsError("--" + name + ": " + v + " is out of range [" + std::to_string(min) + ", " +
                    std::to_string(max) + "]");
  return x;
}

double Args::real(const std::string& name, double min, double max) const {
  std::string v = str(name);
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !std::isfinite(x))
    throw ArgsError("--" + name + ": '" + v + "' is not a number");
  if (x < min || x > max) {
    std::ostringstream os;
    os << "--" << name << ": " << v << " is out of range [" << min << ", " << max << "]";
    throw ArgsError(os.str());
  }
  return x;
}

bool Args::on(const std::string& name) const {
  spec(name);
  return given_.count(name) > 0;
}

std::string Args::choice(const std::string& name, const std::vector<std::string>& choices) const {
  std::string v = str(name);
  std::string list;
  for (const auto& c : choices) {
    if (c == v) return v;
    list += (list.empty() ? "" : "|") + c;
  }
  throw ArgsError("--" + name + ": '" + v + "' is not one of " + list);
}

}  // namespace tandem::examples
