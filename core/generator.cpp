#include "core/generator.h"

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <utility>

#include "core/error.h"

namespace tandem {

namespace {
// MT19937-64's parameters (Matsumoto & Nishimura 2004; std::mt19937_64).
constexpr int kN = static_cast<int>(Generator::kStateWords), kM = 156;
constexpr uint64_t kMatrixA = 0xB5026F5AA96619E9ull;
constexpr uint64_t kUpper = 0xFFFFFFFF80000000ull, kLower = 0x7FFFFFFFull;
}  // namespace

void Generator::seed_locked(uint64_t s) {
  mt_[0] = s;
  for (int i = 1; i < kN; ++i)
    mt_[i] = 6364136223846793005ull * (mt_[i - 1] ^ (mt_[i - 1] >> 62)) + static_cast<uint64_t>(i);
  pos_ = kN;
}

uint64_t Generator::draw() {
  if (pos_ >= static_cast<uint64_t>(kN)) {  // regenerate the whole block
    for (int i = 0; i < kN; ++i) {
      const uint64_t x = (mt_[i] & kUpper) | (mt_[(i + 1) % kN] & kLower);
      mt_[i] = mt_[(i + kM) % kN] ^ (x >> 1) ^ ((x & 1) ? kMatrixA : 0);
    }
    pos_ = 0;
  }
  uint64_t x = mt_[pos_++];
  x ^= (x >> 29) & 0x5555555555555555ull;
  x ^= (x << 17) & 0x71D67FFFEDA60000ull;
  x ^= (x << 37) & 0xFFF7EEE000000000ull;
  x ^= x >> 43;
  return x;
}

void Generator::uniform(double* out, int64_t n, double lo, double hi) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t i = 0; i < n; ++i) out[i] = lo + (hi - lo) * draw_unit();
}

void Generator::normal(double* out, int64_t n, double mean, double stddev) {
  std::lock_guard<std::mutex> lock(mu_);
  const double two_pi = 2.0 * std::acos(-1.0);
  for (int64_t i = 0; i < n; i += 2) {
    const double u1 = draw_unit(), u2 = draw_unit();
    const double r = std::sqrt(-2.0 * std::log(1.0 - u1));  // 1 - u1 in (0, 1]: log is finite
    out[i] = mean + stddev * r * std::cos(two_pi * u2);
    if (i + 1 < n) out[i + 1] = mean + stddev * r * std::sin(two_pi * u2);
  }
}

uint64_t Generator::next_u64() {
  std::lock_guard<std::mutex> lock(mu_);
  return draw();
}

void Generator::permutation(int64_t* out, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t i = 0; i < n; ++i) out[i] = i;
  for (int64_t i = n - 1; i > 0; --i) {
    // Unbiased bounded draw (rejection), so the permutation is the same on every platform.
    uint64_t bound = static_cast<uint64_t>(i + 1);
    uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t r;
    do r = draw(); while (r >= limit);
    std::swap(out[i], out[static_cast<int64_t>(r % bound)]);
  }
}

Tensor Generator::get_state() const {
  Tensor state({kStateBytes}, kUInt8, kCPU);
  auto* p = static_cast<uint8_t*>(state.raw_data());
  std::lock_guard<std::mutex> lock(mu_);
  std::memcpy(p, mt_.data(), kStateWords * 8);  // little-endian host (as safetensors assumes)
  std::memcpy(p + kStateWords * 8, &pos_, 8);
  return state;
}

void Generator::set_state(const Tensor& state) {
  TANDEM_CHECK(state.defined() && state.dtype() == kUInt8 && state.numel() == kStateBytes, Value,
               "Generator::set_state: expected a uint8 tensor of ", kStateBytes, " bytes, got ",
               state.defined() ? dtype_name(state.dtype()) : "undefined", " ",
               state.defined() ? shape_str(state.shape()) : "");
  const Tensor host = state.to(kCPU).contiguous();
  const auto* p = static_cast<const uint8_t*>(host.raw_data());
  std::array<uint64_t, kStateWords> words{};
  uint64_t pos = 0;
  std::memcpy(words.data(), p, kStateWords * 8);
  std::memcpy(&pos, p + kStateWords * 8, 8);
  TANDEM_CHECK(pos <= static_cast<uint64_t>(kN), Value, "Generator::set_state: position ", pos,
               " is not in [0, ", kN, "]");
  bool nonzero = false;
  for (uint64_t w : words) nonzero = nonzero || w != 0;
  TANDEM_CHECK(nonzero, Value, "Generator::set_state: all state words are zero (not a state)");
  std::lock_guard<std::mutex> lock(mu_);
  mt_ = words;
  pos_ = pos;
}

namespace {
std::mutex g_gen_mu;
uint64_t g_seed = 0x5eed;
std::map<std::pair<int, int>, std::unique_ptr<Generator>>& generators() {
  static auto* m = new std::map<std::pair<int, int>, std::unique_ptr<Generator>>();
  return *m;
}
}  // namespace

Generator& default_generator(Device d) {
  std::lock_guard<std::mutex> lock(g_gen_mu);
  auto key = std::make_pair(static_cast<int>(d.type), d.index);
  auto& slot = generators()[key];
  if (!slot) slot = std::make_unique<Generator>(g_seed + 1000003ull * (static_cast<uint64_t>(key.first) * 1024 + key.second));
  return *slot;
}

void manual_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(g_gen_mu);
  g_seed = seed;
  for (auto& [key, gen] : generators())
    gen->seed(seed + 1000003ull * (static_cast<uint64_t>(key.first) * 1024 + key.second));
}

}  // namespace tandem
