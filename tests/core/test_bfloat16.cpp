// The BFloat16 value type (core/bfloat16.h) and the bfloat16 dtype (core/dtype.h): rounding to
// known bit patterns, round trips, the operators, numeric_limits and the dispatchers.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "catch.h"
#include "core/bfloat16.h"
#include "core/dtype.h"
#include "core/error.h"
#include "helpers.h"

using namespace tandem;
using namespace tandem::test;

namespace {

uint16_t round_bits(uint32_t float_bits) {
  return BFloat16(std::bit_cast<float>(float_bits)).bits;
}

bool is_nan_bits(uint16_t b) {
  return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0;
}

// An independent reference for finite floats: of the two bfloat16 neighbours of f, the nearer
// one in exact (double) arithmetic, the even one on a tie. Overflow past the largest finite
// value follows IEEE: a value at or beyond max + half an ulp becomes infinity.
uint16_t nearest_even_reference(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);  // toward zero
  const uint16_t hi = static_cast<uint16_t>(lo + 1);   // away from zero (may be infinity)
  const double a = std::abs(static_cast<double>(std::bit_cast<float>(uint32_t{lo} << 16)));
  // Past the largest finite value the next step would be 2^128 (infinity in bfloat16).
  const double b = (hi & 0x7fffu) == 0x7f80u
                       ? std::ldexp(1.0, 128)
                       : std::abs(static_cast<double>(std::bit_cast<float>(uint32_t{hi} << 16)));
  const double x = std::abs(static_cast<double>(f));
  if (x - a < b - x) return lo;
  if (x - a > b - x) return hi;
  return (lo & 1u) ? hi : lo;
}

}  // namespace

TEST_CASE("bfloat16 rounds float32 to known bit patterns", "[core][bf16]") {
  CHECK(BFloat16(1.0f).bits == 0x3f80);
  CHECK(BFloat16(-2.0f).bits == 0xc000);
  CHECK(BFloat16(0.0f).bits == 0x0000);
  CHECK(BFloat16(-0.0f).bits == 0x8000);
  CHECK(BFloat16(3.0f).bits == 0x4040);
  CHECK(round_bits(0x3eaaaaab) == 0x3eab);  // 1/3: dropped half 0xaaab > 0x8000 rounds up
  // Halfway cases go to the even neighbour: 1 + 2^-8 lies exactly between 1 (0x3f80, even)
  // and 1 + 2^-7 (0x3f81, odd); 1 + 3 * 2^-8 between 0x3f81 (odd) and 0x3f82 (even).
  CHECK(round_bits(0x3f808000) == 0x3f80);
  CHECK(round_bits(0x3f818000) == 0x3f82);
  CHECK(round_bits(0xbf808000) == 0xbf80);  // the same for negatives
  CHECK(round_bits(0x3f808001) == 0x3f81);  // just above halfway rounds up
  CHECK(round_bits(0x3f807fff) == 0x3f80);  // just below rounds down
  // Infinities stay, the largest finite value is exact, and rounding up past it overflows.
  CHECK(BFloat16(std::numeric_limits<float>::infinity()).bits == 0x7f80);
  CHECK(BFloat16(-std::numeric_limits<float>::infinity()).bits == 0xff80);
  CHECK(round_bits(0x7f7f0000) == 0x7f7f);  // 3.3895314e38, the largest finite bfloat16
  CHECK(round_bits(0x7f7f7fff) == 0x7f7f);
  CHECK(round_bits(0x7f7f8000) == 0x7f80);  // a tie with an odd largest value: infinity
  CHECK(BFloat16(std::numeric_limits<float>::max()).bits == 0x7f80);
  // Subnormals round like everything else: 2^-133 is the smallest bfloat16 subnormal.
  CHECK(round_bits(0x00010000) == 0x0001);
  CHECK(round_bits(0x00008000) == 0x0000);  // half of it: a tie, rounds to even zero
  CHECK(round_bits(0x00008001) == 0x0001);
  CHECK(round_bits(0x00018000) == 0x0002);  // 1.5 of it: a tie, rounds to even 2
  CHECK(round_bits(0x007fffff) ==
        0x0080);  // the largest float subnormal rounds up to the smallest normal
  CHECK(round_bits(0x80010000) == 0x8001);
  // NaN stays NaN with its sign, even where plain rounding would carry the payload away.
  CHECK(round_bits(0x7fc00000) == 0x7fc0);
  CHECK(round_bits(0xffc00000) == 0xffc0);
  CHECK(is_nan_bits(round_bits(0x7f800001)));  // only low payload bits: truncation would give inf
  CHECK(is_nan_bits(round_bits(0x7fffffff)));  // rounding up would carry into the sign
  CHECK((round_bits(0x7fffffff) & 0x8000u) == 0);
  CHECK(std::isnan(static_cast<float>(BFloat16(std::nanf("")))));
}

TEST_CASE("bfloat16 rounding matches the nearest-even reference", "[core][bf16]") {
  std::mt19937 rng(123);
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = rng();
    // Half the samples near ties, where a wrong rule shows.
    if (i % 2 == 0) u = (u & 0xffff0000u) | (0x7ffeu + (u & 3u));
    const float f = std::bit_cast<float>(u);
    if (!std::isfinite(f)) continue;
    INFO("float bits 0x" << std::hex << u);
    REQUIRE(BFloat16(f).bits == nearest_even_reference(f));
    ++checked;
  }
  CHECK(checked > 190000);
}

TEST_CASE("bfloat16 round trips through float32 for every bit pattern", "[core][bf16]") {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const BFloat16 h = BFloat16::from_bits(static_cast<uint16_t>(b));
    const float f = static_cast<float>(h);
    INFO("bits 0x" << std::hex << b);
    // To float32 is the shift: exact.
    REQUIRE(std::bit_cast<uint32_t>(f) == b << 16);
    if (is_nan_bits(static_cast<uint16_t>(b))) {
      REQUIRE(is_nan_bits(BFloat16(f).bits));
    } else {
      REQUIRE(BFloat16(f).bits == b);
    }
  }
  // Through double and back (exact both ways for bfloat16 values).
  for (float f : {1.5f, -0.0078125f, 3.3895314e38f, 9.18355e-41f}) {
    CHECK(BFloat16(static_cast<float>(static_cast<double>(BFloat16(f)))).bits == BFloat16(f).bits);
  }
}

TEST_CASE("bfloat16 operators compute in float and round once", "[core][bf16]") {
  const BFloat16 one(1.0f), tiny(0.00390625f);  // 2^-8, exact in bfloat16
  CHECK((one + BFloat16(2.0f)).bits == BFloat16(3.0f).bits);
  CHECK((one + tiny).bits == 0x3f80);         // 1 + 2^-8 is a tie: rounds to even 1
  CHECK((one + tiny + tiny).bits == 0x3f80);  // each step rounds
  CHECK((one + (tiny + tiny)).bits == 0x3f81);
  CHECK((BFloat16(7.0f) - BFloat16(2.0f)).bits == BFloat16(5.0f).bits);
  CHECK((BFloat16(1.5f) * BFloat16(3.0f)).bits == BFloat16(4.5f).bits);
  CHECK((BFloat16(1.0f) / BFloat16(3.0f)).bits == 0x3eab);
  CHECK((-BFloat16(2.0f)).bits == 0xc000);
  CHECK((-BFloat16(0.0f)).bits == 0x8000);
  BFloat16 acc(1.0f);
  acc += BFloat16(0.5f);
  acc *= BFloat16(4.0f);
  acc -= BFloat16(1.0f);
  acc /= BFloat16(2.0f);
  CHECK(static_cast<float>(acc) == 2.5f);
  // Mixed with float or double: computed in that type, not rounded.
  const float mixed = one + 0.00390625f;
  CHECK(mixed == 1.00390625f);
  const double dmixed = 2.0 * BFloat16(1.5f);
  CHECK(dmixed == 3.0);
  // With an integer: stays bfloat16.
  const BFloat16 plus_int = BFloat16(255.0f) + 2;  // 257 is a tie between 256 and 258
  CHECK(plus_int.bits == BFloat16(256.0f).bits);
  // Comparisons, NaN unordered.
  const BFloat16 nan = std::numeric_limits<BFloat16>::quiet_NaN();
  CHECK(BFloat16(1.0f) < BFloat16(2.0f));
  CHECK(BFloat16(2.0f) >= BFloat16(2.0f));
  CHECK(BFloat16(0.0f) == BFloat16(-0.0f));
  CHECK(nan != nan);
  CHECK_FALSE(nan == nan);
  CHECK_FALSE(nan < BFloat16(1.0f));
  CHECK(BFloat16(-1.0f) < 0);
  CHECK(BFloat16(1.0f) > 0.5f);
  CHECK(2.0 > BFloat16(1.5f));
  CHECK(BFloat16(1.00390625f) == 1.0f);  // rounded on construction
}

TEST_CASE("bfloat16 numeric_limits", "[core][bf16]") {
  using L = std::numeric_limits<BFloat16>;
  STATIC_REQUIRE(L::is_specialized);
  STATIC_REQUIRE(L::digits == 8);
  CHECK(L::max().bits == 0x7f7f);
  CHECK(static_cast<float>(L::max()) == 3.38953139e38f);
  CHECK(L::lowest().bits == 0xff7f);
  CHECK(static_cast<float>(L::min()) == std::numeric_limits<float>::min());
  CHECK(static_cast<float>(L::epsilon()) == 0.0078125f);
  CHECK(BFloat16(1.0f + static_cast<float>(L::epsilon())).bits == 0x3f81);
  CHECK(std::isinf(static_cast<float>(L::infinity())));
  CHECK(std::isnan(static_cast<float>(L::quiet_NaN())));
  CHECK(static_cast<float>(L::denorm_min()) == std::ldexp(1.0f, -133));
}

TEST_CASE("bfloat16 dtype and dispatch", "[core][bf16]") {
  CHECK(dtype_size(kBFloat16) == 2);
  CHECK(std::string(dtype_name(kBFloat16)) == "bfloat16");
  CHECK(is_floating(kBFloat16));
  CHECK_FALSE(is_floating(kInt64));
  STATIC_REQUIRE(dtype_of<BFloat16>::value == kBFloat16);
  STATIC_REQUIRE(is_floating_type_v<BFloat16>);
  STATIC_REQUIRE(std::is_same_v<opmath_t<BFloat16>, float>);
  STATIC_REQUIRE(std::is_same_v<opmath_t<double>, double>);
  auto size_of = [](auto tag) { return sizeof(typename decltype(tag)::type); };
  CHECK(dispatch_all(kBFloat16, "op", size_of) == 2);
  CHECK(dispatch_floating_bf16(kBFloat16, "op", size_of) == 2);
  CHECK(dispatch_floating_bf16(kFloat64, "op", size_of) == 8);
  // dispatch_floating stays float32/float64: kernels opt in to bfloat16 (Note [bfloat16 opt-in]).
  const std::string msg =
      error_message<DTypeError>([&] { dispatch_floating(kBFloat16, "my_op", size_of); });
  CHECK(contains(msg, "my_op"));
  CHECK(contains(msg, "bfloat16"));
  const std::string msg2 =
      error_message<DTypeError>([&] { dispatch_floating_bf16(kInt64, "other_op", size_of); });
  CHECK(contains(msg2, "other_op"));
  CHECK(contains(msg2, "int64"));
}
