// Training checkpoints (nn/serialize_checkpoint.h): the model, the optimizer state and the run
// position in one safetensors file, with PyTorch's names; and BatchNorm's batch counter.
#include <filesystem>
#include <memory>

#include "data/data_test_util.h"
#include "helpers.h"
#include "nn/nn.h"
#include "nn/serialize.h"
#include "nn/serialize_checkpoint.h"
#include "nn/state_test_util.h"

using namespace tandem;
using namespace tandem::nn;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::require_identical;
using tandem::test::snapshot;
using tandem::test::TempDir;

TEST_CASE("training checkpoint: PyTorch's names, a round trip, and a resumed run equal to the whole",
          "[nn][serialize]") {
  TempDir dir;
  // A convolution, BatchNorm (its buffers) and a linear layer; Adam for a state with a step.
  auto make = [] {
    Generator g(5);
    return std::make_shared<SequentialImpl>(std::vector<std::shared_ptr<Module>>{
        std::make_shared<Conv2d>(1, 4, 3, 1, 1, true, g), std::make_shared<BatchNorm2d>(4),
        std::make_shared<ReLU>(), std::make_shared<Flatten>(), std::make_shared<Linear>(4 * 8 * 8, 10, true, g)});
  };
  auto x = uniform({4, 1, 8, 8}, -1.0, 1.0);
  auto y = from_vector<int64_t>({1, 2, 3, 4}, {4});
  auto train_steps = [&](Module& net, optim::Optimizer& opt, int steps) {
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      cross_entropy(net(x), y).backward();
      opt.step();
    }
  };
  auto whole = make();
  optim::Adam whole_opt(whole->parameters(), 1e-3);
  train_steps(*whole, whole_opt, 3);

  auto first = make();
  optim::Adam first_opt(first->parameters(), 1e-3);
  train_steps(*first, first_opt, 2);
  default_generator(kCPU).seed(77);
  TrainingCheckpoint c = capture_training_state(*first, first_opt, {kCPU});
  c.epoch = 1;
  c.epoch_step = 2;
  c.step = 9;
  c.config = {{"batch_size", "4"}};
  c.extra.insert("epoch_counts", from_vector<double>({1.5, 2, 3}, {3}));
  const std::string path = dir.file("ckpt.safetensors");
  save_training_checkpoint(path, c);

  // The names, as PyTorch's state_dicts flatten them.
  SafetensorsFile raw = read_safetensors(path);
  CHECK(raw.tensors.contains("model.1.num_batches_tracked"));
  CHECK(raw.tensors.at("model.1.num_batches_tracked").dtype() == kInt64);
  CHECK(raw.tensors.at("model.1.num_batches_tracked").item() == 2.0);
  CHECK(raw.tensors.contains("optimizer.state.0.exp_avg"));
  CHECK(raw.tensors.at("optimizer.state.0.step").item() == 2.0);
  CHECK(raw.tensors.contains("rng_state.cpu:0"));
  CHECK(raw.metadata.at("tandem.kind") == "training_checkpoint");
  CHECK(raw.metadata.at("config.batch_size") == "4");
  CHECK(raw.metadata.at("epoch_step") == "2");

  TrainingCheckpoint back = read_training_checkpoint(path);
  CHECK(back.epoch == 1);
  CHECK(back.epoch_step == 2);
  CHECK(back.step == 9);
  CHECK(back.config.at("batch_size") == "4");
  CHECK(back.extra.at("epoch_counts").to_vector<double>() == std::vector<double>{1.5, 2, 3});

  // A fresh process: new model and optimizer, generator elsewhere; after loading, the third
  // step gives the whole run's weights bit for bit.
  auto second = make();
  optim::Adam second_opt(second->parameters(), 1e-3);
  const uint64_t after_seed = default_generator(kCPU).next_u64();
  default_generator(kCPU).seed(1);
  load_training_state(back, *second, second_opt, path);
  restore_rng_states(back);
  CHECK(default_generator(kCPU).next_u64() == after_seed);
  train_steps(*second, second_opt, 1);
  require_identical(whole->state_dict(), second->state_dict());
  require_identical(whole_opt.state_dict(), second_opt.state_dict());

  SECTION("a model file is not a training checkpoint") {
    save(*first, dir.file("model.safetensors"));
    CHECK(contains(error_message<FormatError>([&] { read_training_checkpoint(dir.file("model.safetensors")); }),
                   "not a training checkpoint"));
  }
  SECTION("a checkpoint of another model names the first tensor") {
    Generator g(1);
    auto net = models::lenet({}, g);
    optim::Adam opt(net->parameters(), 1e-3);
    const StateDict before = snapshot(*net);
    CHECK(contains(error_message<ShapeError>([&] { load_training_state(back, *net, opt, path); }),
                   path + ": tensor 'model.0.weight' has shape [4,1,3,3] in the file but [6,1,5,5]"));
    require_identical(before, net->state_dict());
  }
  SECTION("an optimizer of another kind names the tensor") {
    auto net = make();
    optim::SGD opt(net->parameters(), 0.1, 0.9);
    CHECK(contains(error_message<ValueError>([&] { load_training_state(back, *net, opt, path); }),
                   "'state.0.step'"));
  }
  SECTION("bad metadata and stray tensors are FormatErrors naming the key") {
    StateDict t;
    t.insert("model.w", zeros({1}));
    write_safetensors(dir.file("a.safetensors"), t, {{"tandem.kind", "training_checkpoint"}, {"epoch", "1"},
                                                     {"epoch_step", "x"}, {"step", "3"}});
    CHECK(contains(error_message<FormatError>([&] { read_training_checkpoint(dir.file("a.safetensors")); }),
                   "'epoch_step' is 'x'"));
    write_safetensors(dir.file("b.safetensors"), t, {{"tandem.kind", "training_checkpoint"}, {"epoch", "1"},
                                                     {"step", "3"}});
    CHECK(contains(error_message<FormatError>([&] { read_training_checkpoint(dir.file("b.safetensors")); }),
                   "without 'epoch_step'"));
    t.insert("stray", zeros({1}));
    write_safetensors(dir.file("c.safetensors"), t, {{"tandem.kind", "training_checkpoint"}, {"epoch", "1"},
                                                     {"epoch_step", "0"}, {"step", "3"}});
    CHECK(contains(error_message<FormatError>([&] { read_training_checkpoint(dir.file("c.safetensors")); }),
                   "tensor 'stray'"));
  }
}

TEST_CASE("BatchNorm2d counts its training batches in num_batches_tracked, as PyTorch", "[nn][serialize]") {
  BatchNorm2d bn(3);
  CHECK(bn.state_dict().keys() ==
        std::vector<std::string>{"weight", "bias", "running_mean", "running_var", "num_batches_tracked"});
  Tensor x = uniform({4, 3, 2, 2}, -1.0, 1.0);
  bn(x);
  bn(x);
  CHECK(bn.num_batches_tracked().item() == 2.0);
  bn.eval();
  bn(x);
  CHECK(bn.num_batches_tracked().item() == 2.0);  // eval counts nothing
  bn.reset_running_stats();
  CHECK(bn.num_batches_tracked().item() == 0.0);
}
