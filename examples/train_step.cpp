// A data-parallel training step on one page: d2l's train_batch ("Training on Multiple GPUs")
// in C++, each of its five stages one block of main() built from a piece of parallel/.
// parallel/trainer.cpp is the same step as a reusable class; DataParallel hides it in a module.
//
//   train_step                                 LeNet on Fashion-MNIST on cpu:0,cpu:1
//   train_step --devices cuda:0,cuda:1         on two GPUs (NCCL)
//   train_step --synthetic 512 --epochs 3      tiny generated data: runs anywhere in seconds
#include <algorithm>
#include <cstdio>
#include <random>

#include "autograd/ops.h"
#include "common/args.h"
#include "data/dataloader.h"
#include "data/fashion_mnist.h"
#include "nn/models/lenet.h"
#include "nn/optim/sgd.h"
#include "parallel/comm.h"
#include "parallel/parallel_apply.h"
#include "parallel/replicate.h"
#include "parallel/scatter.h"

using namespace tandem;

// n images of 28x28: noise with a bright band of rows whose place gives the label.
data::TensorDataset synthetic(int64_t n) {
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> noise(0.0f, 0.5f);
  std::vector<float> px(static_cast<size_t>(n * 784));
  std::vector<int64_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    labels[i] = i % 10;
    for (int64_t p = 0; p < 784; ++p) {
      const int64_t row = p / 28;
      px[i * 784 + p] = row >= 2 * labels[i] + 4 && row < 2 * labels[i] + 7 ? 1.0f : noise(rng);
    }
  }
  return {from_vector(px, {n, 1, 28, 28}), from_vector(labels, {n})};
}

int main(int argc, char** argv) {
  examples::Args args("train_step", "One data-parallel training step, written out: LeNet on several devices.");
  args.option("devices", "cpu:0,cpu:1", "devices to train on (virtual CPU devices or GPUs)");
  args.option("synthetic", "0", "train on N generated images instead of Fashion-MNIST (0: off)");
  args.option("data", data::kFashionMnistDefaultDir, "folder with the Fashion-MNIST IDX files");
  args.option("epochs", "2", "training epochs");
  args.option("batch-size", "256", "global minibatch size, split across the devices");
  args.option("lr", "0.9", "SGD learning rate (0.9 suits the sigmoid network, 0.1 the ReLU one)");
  args.option("activation", "sigmoid", "sigmoid (with average pooling, d2l's LeNet) or relu (with max pooling)");
  std::vector<Device> devices;
  int64_t n_synth, epochs, batch;
  double lr;
  nn::models::LeNetOptions net;
  try {
    if (!args.parse(argc, argv)) return std::fputs(args.help().c_str(), stdout), 0;
    devices = parse_device_list(args.str("devices"));
    for (Device d : devices) check_device_exists(d);
    n_synth = args.integer("synthetic", 0);
    epochs = args.integer("epochs", 1, 1000);
    batch = args.integer("batch-size", static_cast<int64_t>(devices.size()));
    lr = args.real("lr", 0.0);
    if (args.choice("activation", {"sigmoid", "relu"}) == "relu") net.activation = nn::models::LeNetActivation::ReLU;
  } catch (const std::exception& e) {  // a bad flag or device: exit 2
    std::fprintf(stderr, "train_step: %s\n", e.what());
    return 2;
  }
  try {
    const data::TensorDataset dataset = n_synth > 0 ? synthetic(n_synth) : [&] {
      data::FashionMnist train = data::load_fashion_mnist(args.str("data"), true);
      return data::TensorDataset(train.images, train.labels);
    }();
    batch = std::min(batch, dataset.size());
    data::DataLoader loader(dataset, {.batch_size = batch, .shuffle = true, .drop_last = true});

    // One model copy per device, made once and kept equal by identical updates; one host
    // thread per device; a communicator for the gradients; one optimizer per replica.
    parallel::Replicas replicas = parallel::replicate(nn::models::lenet(net), devices);
    parallel::DeviceWorkers workers(devices);
    auto comm = parallel::make_communicator(devices[0].is_cuda() ? "nccl" : "ring", devices);
    std::vector<std::vector<Tensor>> params;  // [replica][parameter]
    std::vector<std::unique_ptr<nn::optim::SGD>> optimizers;
    for (auto& replica : replicas) {
      params.push_back(replica->parameters());
      optimizers.push_back(std::make_unique<nn::optim::SGD>(params.back(), lr));
    }

    for (int64_t epoch = 1; epoch <= epochs; ++epoch) {
      double loss_sum = 0;
      for (const data::Batch& b : loader) {
        // 1. Split the batch along dim 0, one shard per device.
        const std::vector<int64_t> sizes = parallel::split_sizes(b.x.size(0), devices.size());
        const std::vector<Tensor> xs = parallel::scatter(b.x, sizes, devices);
        const std::vector<Tensor> ys = parallel::scatter(b.y, sizes, devices);
        // 2 + 3. Forward, loss and backward of every replica at once, each on its own device.
        // The shard's mean loss is scaled by its share of rows, so that the *sum* of the
        // replicas' gradients is the gradient of the global batch's mean loss.
        const std::vector<Tensor> losses = parallel::parallel_apply(workers, [&](size_t r) {
          optimizers[r]->zero_grad();
          Tensor loss = mul(cross_entropy((*replicas[r])(xs[r]), ys[r]), double(sizes[r]) / double(b.x.size(0)));
          loss.backward();
          return loss.detach();
        });
        // 4. Allreduce: every replica's gradient becomes the sum over the replicas.
        for (size_t k = 0; k < params[0].size(); ++k) {
          std::vector<Tensor> grads;  // parameter k's gradient on every device
          for (const auto& p : params) grads.push_back(p[k].grad());
          comm->allreduce_sum(grads);
        }
        // 5. The same update from the same gradient on every replica.
        workers.run([&](size_t r) { optimizers[r]->step(); });
        for (const Tensor& l : losses) loss_sum += l.item() * static_cast<double>(b.x.size(0));
      }
      const double rows = static_cast<double>(loader.num_batches() * batch);
      std::printf("epoch %lld  loss %.4f  replicas differ by %g\n", static_cast<long long>(epoch), loss_sum / rows,
                  parallel::replicas_max_difference(replicas));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_step: %s\n", e.what());
    return 1;
  }
  return 0;
}
