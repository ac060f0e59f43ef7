#include "common/train.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "common/stepper.h"
#include "data/dataloader.h"
#include "data/fashion_mnist.h"
#include "kernels/ops.h"

namespace tandem::examples {

std::vector<Device> default_devices() {
  return {cuda_available() ? Device::cuda(0) : kCPU};
}

namespace {

// Test accuracy of `model` (on its device) over the whole test loader, in eval mode.
double evaluate(nn::Module& model, data::DataLoader& loader) {
  model.eval();
  NoGradGuard no_grad;
  Tensor correct = zeros({1}, kInt64, loader.options().device);
  for (const data::Batch& b : loader) kernels::count_correct(model(b.x), b.y, correct);
  model.train();
  return correct.item() / static_cast<double>(loader.size());
}

}  // namespace

double epoch_lr(const TrainConfig& cfg, int64_t epoch) {
  if (cfg.lr_schedule != "cosine") return cfg.lr;
  const double pi = std::acos(-1.0);
  return cfg.lr * 0.5 * (1.0 + std::cos(pi * static_cast<double>(epoch - 1) / static_cast<double>(cfg.epochs)));
}

void run_training(const TrainConfig& cfg, const std::function<void(const EpochStats&)>& on_epoch) {
  TANDEM_CHECK(!cfg.devices.empty(), Value, "no devices given");
  for (Device d : cfg.devices) check_device_exists(d);
  Device home = cfg.devices.front();  // data lives here; batches are split from here
  CsvLog csv(cfg.csv);  // fails before any work when the file cannot be written

  data::FashionMnist train = data::load_fashion_mnist(cfg.data_dir, true, cfg.train_limit);
  data::FashionMnist test = data::load_fashion_mnist(cfg.data_dir, false, cfg.test_limit);
  data::DataLoader train_loader(data::TensorDataset(train.images, train.labels),
                                {.batch_size = std::min<int64_t>(cfg.batch_size, train.images.size(0)),
                                 .shuffle = true, .drop_last = cfg.drop_last, .seed = cfg.seed, .device = home});
  data::DataLoader test_loader(data::TensorDataset(test.images, test.labels),
                               {.batch_size = std::min<int64_t>(1000, test.images.size(0)),
                                .shuffle = false, .drop_last = false, .seed = 0, .device = home});

  std::unique_ptr<Stepper> stepper = make_stepper(cfg);

  for (int64_t epoch = 1; epoch <= cfg.epochs; ++epoch) {
    Tensor loss_sum = zeros({}, kFloat32, home);
    Tensor correct = zeros({1}, kInt64, home);
    stepper->set_lr(epoch_lr(cfg, epoch));
    Progress progress(train_loader.num_batches(), "epoch " + std::to_string(epoch));
    synchronize_all();
    auto t0 = std::chrono::steady_clock::now();
    int64_t seen = 0, step = 0;
    for (const data::Batch& b : train_loader) {
      stepper->step(b.x, b.y, loss_sum, correct);
      seen += b.x.size(0);
      if (cfg.progress) progress.update(++step);
    }
    stepper->end_epoch(correct);
    // The one host synchronization of the epoch: read the accumulated loss and accuracy.
    EpochStats s;
    s.epoch = epoch;
    s.loss = loss_sum.item() / static_cast<double>(seen);
    s.train_acc = correct.item() / static_cast<double>(seen);
    synchronize_all();
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    s.images_per_s = static_cast<double>(seen) / s.seconds;
    progress.finish();
    if (cfg.evaluate) s.test_acc = evaluate(stepper->eval_model(), test_loader);
    if (!cfg.trace.empty() && epoch == 1) stepper->write_trace(cfg.trace);
    csv.add(s);
    on_epoch(s);
  }
}

}  // namespace tandem::examples
