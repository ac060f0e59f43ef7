// Generator: the engine is MT19937-64 word for word, the words map to doubles as Note [portable
// random doubles] (core/generator.h) says, a fixed seed gives fixed values, and get_state() /
// set_state() replay the draws that followed.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "catch.h"
#include "core/error.h"
#include "core/generator.h"
#include "helpers.h"

using namespace tandem;
using tandem::test::contains;
using tandem::test::error_message;

namespace {

// The same bits as a double literal: fixed values are compared exactly.
uint64_t bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}

}  // namespace

TEST_CASE("Generator's engine is MT19937-64, as std::mt19937_64 specifies", "[core]") {
  for (uint64_t seed : {uint64_t{0}, uint64_t{5489}, uint64_t{0x5eed}, ~uint64_t{0}}) {
    Generator gen(seed);
    std::mt19937_64 ref(seed);
    for (int i = 0; i < 1000; ++i) REQUIRE(gen.next_u64() == ref());
  }
  // The standard's own check: the 10000th word of the default seed (5489).
  Generator gen(5489);
  uint64_t w = 0;
  for (int i = 0; i < 10000; ++i) w = gen.next_u64();
  CHECK(w == 9981545732273789042ull);
}

TEST_CASE("Generator maps words to doubles portably: 53 bits for uniform, Box-Muller for normal", "[core]") {
  SECTION("uniform is (word >> 11) * 2^-53, scaled to [lo, hi)") {
    Generator gen(42);
    std::mt19937_64 ref(42);
    std::vector<double> u(101);
    gen.uniform(u.data(), 101, -2.0, 3.0);
    for (double v : u) {
      const double unit = static_cast<double>(ref() >> 11) * 0x1.0p-53;
      REQUIRE(bits(v) == bits(-2.0 + 5.0 * unit));
      REQUIRE((v >= -2.0 && v < 3.0));
    }
  }
  SECTION("normal takes z0, z1 of each pair of uniforms; an odd count drops the last z1") {
    Generator gen(7);
    std::mt19937_64 ref(7);
    std::vector<double> z(5);
    gen.normal(z.data(), 5, 1.0, 2.0);
    const double two_pi = 2.0 * std::acos(-1.0);
    for (int i = 0; i < 5; i += 2) {
      const double u1 = static_cast<double>(ref() >> 11) * 0x1.0p-53;
      const double u2 = static_cast<double>(ref() >> 11) * 0x1.0p-53;
      const double r = std::sqrt(-2.0 * std::log(1.0 - u1));
      REQUIRE(bits(z[i]) == bits(1.0 + 2.0 * r * std::cos(two_pi * u2)));
      if (i + 1 < 5) REQUIRE(bits(z[i + 1]) == bits(1.0 + 2.0 * r * std::sin(two_pi * u2)));
    }
    // Three pairs were used: the next word is the seventh.
    CHECK(gen.next_u64() == ref());
  }
  SECTION("fixed values for a fixed seed (these change only if the mapping or the engine does)") {
    // Computed once by an independent implementation of MT19937-64 and of the mapping.
    Generator gen(0);
    std::vector<double> u(3), z(2);
    gen.uniform(u.data(), 3, 0.0, 1.0);
    gen.normal(z.data(), 2, 0.0, 1.0);
    CHECK(u[0] == 0x1.4741be2e5a0ecp-3);
    CHECK(u[1] == 0x1.fbfa74f87c81fp-1);
    CHECK(u[2] == 0x1.442642fe065d0p-5);
    CHECK(std::fabs(z[0] - -1.3017724326772173) < 1e-15);
    CHECK(std::fabs(z[1] - -0.3542349180596067) < 1e-15);
    int64_t perm[5];
    Generator(0).permutation(perm, 5);
    CHECK(std::vector<int64_t>(perm, perm + 5) == std::vector<int64_t>{2, 0, 1, 3, 4});
  }
}

TEST_CASE("Generator get_state / set_state replay the draws that followed", "[core]") {
  Generator gen(123);
  std::vector<double> skip(777);
  gen.uniform(skip.data(), 777, 0.0, 1.0);  // mid-block: the position matters too
  const Tensor state = gen.get_state();
  CHECK(state.dtype() == kUInt8);
  CHECK(state.numel() == Generator::kStateBytes);
  std::vector<double> a(50), b(50);
  gen.normal(a.data(), 50, 0.0, 1.0);
  const uint64_t wa = gen.next_u64();

  Generator other(999);
  other.set_state(state);
  other.normal(b.data(), 50, 0.0, 1.0);
  CHECK(a == b);
  CHECK(other.next_u64() == wa);

  SECTION("bad states are a ValueError naming what is wrong") {
    Generator g;
    CHECK(contains(error_message<ValueError>([&] { g.set_state(zeros({10}, kUInt8)); }), "2504"));
    CHECK(contains(error_message<ValueError>([&] { g.set_state(zeros({Generator::kStateBytes}, kFloat32)); }),
                   "uint8"));
    CHECK(contains(error_message<ValueError>([&] { g.set_state(zeros({Generator::kStateBytes}, kUInt8)); }),
                   "zero"));
    Tensor bad = state.clone();
    static_cast<uint8_t*>(bad.raw_data())[Generator::kStateBytes - 8] = 200;  // position 200 + ...
    static_cast<uint8_t*>(bad.raw_data())[Generator::kStateBytes - 7] = 1;    // ... 256 = 456
    CHECK(contains(error_message<ValueError>([&] { g.set_state(bad); }), "position 456"));
    // A failed set_state leaves the generator as it was.
    Generator fresh;
    CHECK(g.next_u64() == fresh.next_u64());
  }
}
