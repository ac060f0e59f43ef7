#pragma once
// The model and the global batches of the multi-process tests: tests/distributed/dist_worker.cpp
// trains them in every rank, and tests/parallel/test_same_numbers.cpp trains the very same ones
// in one process to compare.
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "nn/nn.h"

namespace tandem::test {

// Conv(1->4, 3x3) [BatchNorm] ReLU Flatten Linear(144->16) ReLU Linear(16->classes), from `seed`.
inline std::shared_ptr<nn::Module> dist_test_net(uint64_t seed, bool bn, int64_t classes = 5) {
  Generator gen(seed);
  auto seq = std::make_shared<nn::SequentialImpl>();
  auto add = [&](std::shared_ptr<nn::Module> m) { seq->push_back(std::move(m)); };
  add(std::make_shared<nn::Conv2d>(1, 4, 3, 1, 1, true, gen));
  if (bn) add(std::make_shared<nn::BatchNorm2d>(4));
  add(std::make_shared<nn::ReLU>());
  add(std::make_shared<nn::Flatten>());
  add(std::make_shared<nn::Linear>(4 * 6 * 6, 16, true, gen));
  add(std::make_shared<nn::ReLU>());
  add(std::make_shared<nn::Linear>(16, classes, true, gen));
  return seq;
}

// The same global batches on every rank: x [batch, 1, 6, 6] and labels in [0, 5), on `device`.
inline std::vector<std::pair<Tensor, Tensor>> dist_test_batches(int steps, int64_t batch, Device device = kCPU) {
  Generator gen(1234);
  std::vector<std::pair<Tensor, Tensor>> out;
  for (int s = 0; s < steps; ++s) {
    Tensor x = randn({batch, 1, 6, 6}, kFloat32, kCPU, &gen);
    std::vector<int64_t> y(static_cast<size_t>(batch));
    for (auto& l : y) l = static_cast<int64_t>(gen.next_u64() % 5);
    out.emplace_back(x.to(device), from_vector<int64_t>(y, {batch}, device));
  }
  return out;
}

// The worker's "params HASH": FNV-1a over the float32 bits of every parameter, in order.
inline uint64_t dist_params_hash(const nn::Module& m) {
  uint64_t h = 1469598103934665603ull;
  for (const Tensor& p : m.parameters()) {
    for (float v : p.to_vector<float>()) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      h = (h ^ bits) * 1099511628211ull;
    }
  }
  return h;
}

}  // namespace tandem::test
