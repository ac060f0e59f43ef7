#pragma once
// Seeded random number generators, one default per device.
//
// Random numbers are drawn on the host from a counter-free 64-bit engine (std::mt19937_64) in
// a fixed order and copied to the device, so a seed gives the same values on every device and
// the same run bit for bit on the CPU. Random draws happen at initialization and shuffling,
// never in the hot loop, so the host path costs nothing that matters.
#include <cstdint>
#include <mutex>
#include <random>

#include "core/device.h"

namespace tandem {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0x5eed) : engine_(seed) {}
  void seed(uint64_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    engine_.seed(s);
  }
  // Fills out[0..n) with uniform [lo, hi) / normal(mean, stddev) doubles.
  void uniform(double* out, int64_t n, double lo, double hi);
  void normal(double* out, int64_t n, double mean, double stddev);
  uint64_t next_u64();
  // A uniformly random permutation of [0, n) (Fisher-Yates).
  void permutation(int64_t* out, int64_t n);

 private:
  std::mutex mu_;
  std::mt19937_64 engine_;
};

// The default generator of a device (one per device, created on first use).
Generator& default_generator(Device d = kCPU);
// Seeds the default generators of every device (those created later too).
void manual_seed(uint64_t seed);

}  // namespace tandem
