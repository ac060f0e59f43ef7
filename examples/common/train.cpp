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
#include "parallel/dist/process_group.h"

namespace tandem::examples {

std::vector<Device> default_devices() {
  return {cuda_available() ? Device::cuda(0) : kCPU};
}

bool reports(const TrainConfig& cfg) { return !cfg.group || cfg.group->rank() == 0; }

namespace {

// Test accuracy of the stepper's model over the whole test set, in eval mode: this process's
// loader (all of the test set, or a rank's unpadded share of it), the right answers summed
// over the job's processes.
double evaluate(Stepper& stepper, data::DataLoader& loader) {
  nn::Module& model = stepper.eval_model();
  model.eval();
  Tensor correct = zeros({1}, kInt64, loader.options().device);
  {
    NoGradGuard no_grad;
    for (const data::Batch& b : loader) kernels::count_correct(model(b.x), b.y, correct);
  }
  model.train();
  stepper.sum_across_processes(correct);
  return correct.item() / static_cast<double>(loader.size());
}

// [loss_sum, correct, seen] as one float64 tensor [3] on the device, for one reduction across
// processes and one read.
Tensor epoch_counts(const Tensor& loss_sum, const Tensor& correct, int64_t seen) {
  Tensor counts = zeros({3}, kFloat64, loss_sum.device());
  counts.slice(0, 0, 1).copy_(loss_sum.reshape({1}));
  counts.slice(0, 1, 2).copy_(correct);
  counts.slice(0, 2, 3).fill_(static_cast<double>(seen));
  return counts;
}

}  // namespace

double epoch_lr(const TrainConfig& cfg, int64_t epoch) {
  if (cfg.lr_schedule != "cosine") return cfg.lr;
  const double pi = std::acos(-1.0);
  return cfg.lr * 0.5 * (1.0 + std::cos(pi * static_cast<double>(epoch - 1) / static_cast<double>(cfg.epochs)));
}

void run_training(const TrainConfig& cfg, const std::function<void(const EpochStats&)>& on_epoch) {
  TANDEM_CHECK(!cfg.devices.empty(), Value, "no devices given");
  TANDEM_CHECK(!cfg.group || cfg.devices.size() == 1, Value, "one device per process in a multi-process run, got ",
               cfg.devices.size());
  for (Device d : cfg.devices) check_device_exists(d);
  Device home = cfg.devices.front();  // data lives here; batches are split from here
  const bool reporting = reports(cfg);
  CsvLog csv(reporting ? cfg.csv : "");  // fails before any work when the file cannot be written

  data::FashionMnist train = data::load_fashion_mnist(cfg.data_dir, true, cfg.train_limit);
  data::FashionMnist test = data::load_fashion_mnist(cfg.data_dir, false, cfg.test_limit);
  const int64_t n_train = train.images.size(0), n_test = test.images.size(0);

  std::unique_ptr<Stepper> stepper = make_stepper(cfg);

  // In a job, each rank's loaders read its sampler's share; batch_size stays the global batch
  // (Note [global batches across ranks] in data/dataloader.h).
  std::shared_ptr<data::DistributedSampler> train_sampler = stepper->sampler(n_train, true);
  data::DataLoader train_loader(data::TensorDataset(train.images, train.labels),
                                {.batch_size = std::min<int64_t>(cfg.batch_size, n_train), .shuffle = true,
                                 .drop_last = cfg.drop_last, .seed = cfg.seed, .device = home,
                                 .sampler = train_sampler});
  data::DataLoader test_loader(data::TensorDataset(test.images, test.labels),
                               {.batch_size = std::min<int64_t>(1000, n_test), .shuffle = false,
                                .drop_last = false, .seed = 0, .device = home,
                                .sampler = stepper->sampler(n_test, false)});

  for (int64_t epoch = 1; epoch <= cfg.epochs; ++epoch) {
    if (train_sampler) train_sampler->set_epoch(epoch - 1);  // the same order as one process's epoch
    Tensor loss_sum = zeros({}, kFloat32, home);
    Tensor correct = zeros({1}, kInt64, home);
    stepper->set_lr(epoch_lr(cfg, epoch));
    Progress progress(train_loader.num_batches(), "epoch " + std::to_string(epoch));
    synchronize_all();
    auto t0 = std::chrono::steady_clock::now();
    int64_t seen = 0, step = 0;
    for (const data::Batch& b : train_loader) {
      stepper->step(b.x, b.y, train_loader.global_batch_rows(step), loss_sum, correct);
      seen += b.x.size(0);
      ++step;
      if (cfg.progress && reporting) progress.update(step);
    }
    stepper->end_epoch(correct);
    // The one host synchronization of the epoch: read the accumulated loss and accuracy, summed
    // over the processes of a job.
    Tensor counts = epoch_counts(loss_sum, correct, seen);
    stepper->sum_across_processes(counts);
    const std::vector<double> c = counts.to_vector<double>();  // loss_sum, correct, seen
    EpochStats s;
    s.epoch = epoch;
    s.loss = c[0] / c[2];
    s.train_acc = c[1] / c[2];
    synchronize_all();
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    s.images_per_s = c[2] / s.seconds;
    progress.finish();
    if (cfg.evaluate) s.test_acc = evaluate(*stepper, test_loader);
    if (!cfg.trace.empty() && epoch == 1) stepper->write_trace(cfg.trace);  // every rank takes part
    csv.add(s);
    on_epoch(s);
  }
}

}  // namespace tandem::examples
