#pragma once
// Shared by the parallel tests: small models, random batches, the one-device
// reference run, error messages.
#include <memory>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "catch.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/ops.h"
#include "nn/nn.h"
#include "parallel/parallel.h"

namespace tandem::test {


// 8 -> 16 -> 4 MLP with ReLU.
inline std::shared_ptr<nn::Module> small_mlp(Generator& gen) {
  return std::make_shared<nn::SequentialImpl>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(8, 16, true, gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(16, 4, true, gen)});
}

// Random float32 inputs [batch, rest...] and int64 labels [batch] in [0, classes).
inline std::pair<Tensor, Tensor> random_batch(int64_t batch, const Shape& rest, int64_t classes,
                                              Generator& gen, Device device = kCPU) {
  Shape shape = {batch};
  shape.insert(shape.end(), rest.begin(), rest.end());
  Tensor x = randn(shape, kFloat32, kCPU, &gen);
  std::vector<int64_t> labels(static_cast<size_t>(batch));
  for (auto& l : labels) l = static_cast<int64_t>(gen.next_u64() % uint64_t(classes));
  return {x.to(device), from_vector<int64_t>(labels, {batch}).to(device)};
}

inline parallel::OptimizerFactory sgd_factory(double lr, double momentum) {
  return [=](std::vector<Tensor> ps) {
    return std::make_unique<nn::optim::SGD>(std::move(ps), lr, momentum);
  };
}

// SGD whose learning rate lives on the device, so a change reaches graph replays.
inline parallel::OptimizerFactory capturable_sgd(double lr, double momentum) {
  return [=](std::vector<Tensor> ps) {
    return std::make_unique<nn::optim::SGD>(std::move(ps), nn::optim::SGDOptions(lr).momentum(momentum).capturable(true));
  };
}

struct ReferenceRun {
  std::vector<double> losses;  // per step, before the update
  int64_t correct = 0;         // rows predicted right, summed over the steps
};

// SGD on one device, mean cross-entropy over each whole batch: what data-parallel training
// must reproduce.
inline ReferenceRun train_reference(nn::Module& net,
                                    const std::vector<std::pair<Tensor, Tensor>>& batches,
                                    double lr, double momentum) {
  nn::optim::SGD opt(net.parameters(), lr, momentum);
  ReferenceRun run;
  Tensor correct = zeros({1}, kInt64, net.device());
  for (const auto& [x, y] : batches) {
    opt.zero_grad();
    Tensor logits = net.forward(x.to(net.device()));
    Tensor loss = cross_entropy(logits, y.to(net.device()));
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item());
    kernels::count_correct(logits.detach(), y.to(net.device()), correct);
  }
  run.correct = static_cast<int64_t>(correct.item());
  return run;
}

inline std::vector<std::pair<Tensor, Tensor>> random_batches(int steps, int64_t batch,
                                                             const Shape& rest, Generator& gen) {
  std::vector<std::pair<Tensor, Tensor>> out;
  for (int i = 0; i < steps; ++i) out.push_back(random_batch(batch, rest, 4, gen));
  return out;
}

// Largest rel_error over the parameters of two modules of the same structure.
inline double max_param_error(const nn::Module& a, const nn::Module& b) {
  const auto pa = a.parameters(), pb = b.parameters();
  REQUIRE(pa.size() == pb.size());
  double worst = 0;
  for (size_t k = 0; k < pa.size(); ++k) worst = std::max(worst, rel_error(pa[k], pb[k]));
  return worst;
}

// Two GPUs, or a warning and false.
inline bool have_two_gpus() {
  if (cuda_device_count() >= 2) return true;
  WARN("fewer than 2 GPUs: multi-GPU part skipped");
  return false;
}

}  // namespace tandem::test
