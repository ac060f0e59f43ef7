#pragma once
// Comparing module states bit for bit, for the serialization and checkpoint tests.
#include <cstdint>
#include <vector>

#include "catch.h"
#include "nn/module.h"

namespace tandem::test {

inline std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor c = t.to(kCPU).contiguous();
  const auto* p = static_cast<const uint8_t*>(c.raw_data());
  return std::vector<uint8_t>(p, p + c.nbytes());
}

// Every tensor of a and b: same names, order, dtypes, shapes and bytes.
inline void require_identical(const nn::StateDict& a, const nn::StateDict& b) {
  REQUIRE(a.keys() == b.keys());
  for (const auto& [name, t] : a) {
    INFO("tensor " << name);
    const Tensor& u = b.at(name);
    REQUIRE(t.dtype() == u.dtype());
    REQUIRE(t.shape() == u.shape());
    REQUIRE(bytes_of(t) == bytes_of(u));
  }
}

// A deep snapshot of a module's state (state_dict() aliases the module).
inline nn::StateDict snapshot(const nn::Module& m) {
  nn::StateDict out;
  for (const auto& [name, t] : m.state_dict()) out.insert(name, t.clone());
  return out;
}

}  // namespace tandem::test
