#include "core/generator.h"

#include <map>
#include <memory>
#include <utility>

namespace tandem {

void Generator::uniform(double* out, int64_t n, double lo, double hi) {
  std::lock_guard<std::mutex> lock(mu_);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (int64_t i = 0; i < n; ++i) out[i] = dist(engine_);
}

void Generator::normal(double* out, int64_t n, double mean, double stddev) {
  std::lock_guard<std::mutex> lock(mu_);
  std::normal_distribution<double> dist(mean, stddev);
  for (int64_t i = 0; i < n; ++i) out[i] = dist(engine_);
}

uint64_t Generator::next_u64() {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_();
}

void Generator::permutation(int64_t* out, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t i = 0; i < n; ++i) out[i] = i;
  for (int64_t i = n - 1; i > 0; --i) {
    // Unbiased bounded draw (rejection), so the permutation is the same on every platform.
    uint64_t bound = static_cast<uint64_t>(i + 1);
    uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t r;
    do r = engine_(); while (r >= limit);
    std::swap(out[i], out[static_cast<int64_t>(r % bound)]);
  }
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
