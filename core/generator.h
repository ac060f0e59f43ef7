#pragma once
// Seeded random number generators, one default per device.
//
// Random numbers are drawn on the host from a 64-bit Mersenne Twister (MT19937-64, the engine
// std::mt19937_64 specifies, written out here so its state can be saved and restored) in a
// fixed order and copied to the device, so a seed gives the same values on every device and
// the same run bit for bit on the CPU. Random draws happen at initialization and shuffling,
// never in the hot loop, so the host path costs nothing that matters.
//
// Note [portable random doubles]: the standard library's distributions are not specified bit
// for bit (libstdc++, libc++ and MSVC give different numbers for one seed), so the engine's
// words are mapped to doubles here, as PyTorch's CPU generator does:
//   uniform [0, 1)   (word >> 11) * 2^-53: the top 53 bits, every double a multiple of 2^-53
//   uniform [lo, hi) lo + (hi - lo) * u
//   normal           Box-Muller on two uniforms u1, u2 (one word each):
//                    r = sqrt(-2 log(1 - u1)), z0 = r cos(2 pi u2), z1 = r sin(2 pi u2);
//                    normal() fills its output with z0, z1, z0, z1, ... of successive pairs
//                    (an odd count drops the last z1), so no value is cached between calls
//                    and the whole state is the engine's.
// The only platform dependence left is the libm's log, sqrt, cos and sin in normal().
#include <array>
#include <cstdint>
#include <mutex>

#include "core/device.h"
#include "core/tensor.h"

namespace tandem {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0x5eed) { seed_locked(seed); }
  void seed(uint64_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    seed_locked(s);
  }
  // Fills out[0..n) with uniform [lo, hi) / normal(mean, stddev) doubles (Note [portable
  // random doubles]).
  void uniform(double* out, int64_t n, double lo, double hi);
  void normal(double* out, int64_t n, double mean, double stddev);
  uint64_t next_u64();
  // A uniformly random permutation of [0, n) (Fisher-Yates).
  void permutation(int64_t* out, int64_t n);

  // The engine's whole state as a uint8 CPU tensor [kStateBytes] (torch.Generator.get_state):
  // the 312 state words, then the position in them, each a little-endian uint64.
  Tensor get_state() const;
  // Restores a state from get_state(): the draws that follow are those that followed it.
  // ValueError unless `state` is a uint8 tensor of kStateBytes elements with a position in
  // [0, 312] and not all words zero.
  void set_state(const Tensor& state);
  static constexpr int64_t kStateWords = 312;
  static constexpr int64_t kStateBytes = (kStateWords + 1) * 8;

 private:
  void seed_locked(uint64_t s);
  uint64_t draw();  // the next engine word; mu_ held
  double draw_unit() { return static_cast<double>(draw() >> 11) * 0x1.0p-53; }

  mutable std::mutex mu_;
  std::array<uint64_t, kStateWords> mt_{};
  uint64_t pos_ = kStateWords;
};

// The default generator of a device (one per device, created on first use).
Generator& default_generator(Device d = kCPU);
// Seeds the default generators of every device (those created later too).
void manual_seed(uint64_t seed);

}  // namespace tandem
