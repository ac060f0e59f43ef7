#include "common/train.h"

#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>

#include "autograd/autocast.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "common/checkpoint.h"
#include "common/stepper.h"
#include "data/dataloader.h"
#include "data/fashion_mnist.h"
#include "kernels/ops.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/serialize_checkpoint.h"
#include "parallel/distributed/process_group.h"

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
  // torch.optim.lr_scheduler.CosineAnnealingLR(T_max = epochs) stepped once per epoch: epoch 1
  // is its epoch 0. Without an optimizer: the stepper sets the lr of its optimizers itself.
  return nn::optim::CosineAnnealingLR(cfg.lr, cfg.epochs).lr_at(epoch - 1);
}

namespace {

// Note [when the ranks look at the loss and the signals]: reading the loss after every step
// would make the host wait for the devices every step (docs/00-design.md, invariant 3). Instead each
// step copies the epoch's running loss sum into a small window on the device, and the driver
// reads the window only at a check: every --checkpoint-every steps of the run (100 without
// it), at the end of an epoch, and -- in a single process -- after the step in which a signal
// arrived. A sum stays NaN or Inf once a term is, so the first bad entry is the step whose
// loss went bad. In a job the window is summed over the ranks, with one more entry that
// counts the ranks that got a signal: every rank sees the same verdict at the same step and
// they stop together, a signal waiting for the next check.
constexpr int64_t kDefaultCheckEvery = 100;

// Note [the loss window inside the step]: that copy is one small kernel between two steps, the
// only launch between two replays of a step's CUDA graph (LeNet: 0.6 us of a kernel in the
// 5 us from one replay's end to the next one's start). A stepper that can
// (Stepper::append_loss_sums: the one-device step, beside its backward; a data-parallel rank,
// at the end of its step and of an empty shard's stand-in) appends the sum itself, inside its
// graph, at a cursor on the device (examples' LossLog); the window is then zeroed after each
// check (the append adds into it) and its cursor reset. The driver still counts the steps.
class LossWindow {
 public:
  LossWindow(int64_t steps, Device d)
      : window_(zeros({steps + 1}, kFloat64, d)), cursor_(zeros({1}, kInt64, d)), steps_(steps) {}

  // Asks the stepper to append the sums itself (Note [the loss window inside the step]).
  void offer(Stepper& stepper) { by_stepper_ = stepper.append_loss_sums(window_, cursor_); }

  void record(const Tensor& loss_sum) {
    TANDEM_CHECK(n_ < steps_, Value, "LossWindow: more steps than ", steps_, " between two checks");
    if (!by_stepper_) window_.slice(0, n_, n_ + 1).copy_(loss_sum.reshape({1}));
    ++n_;
  }
  int64_t size() const { return n_; }

  // One read (and in a job one sum over the ranks) of the steps since the last check: the
  // index of the first step with a non-finite loss sum (-1: none) and that sum, and whether
  // any rank asked to stop. Starts a new window.
  struct Verdict {
    int64_t bad;
    double value;
    bool stop;
  };
  Verdict check(Stepper& stepper, bool stop_here) {
    window_.slice(0, steps_, steps_ + 1).fill_(stop_here ? 1.0 : 0.0);
    stepper.sum_across_processes(window_);
    const std::vector<double> w = window_.to_vector<double>();
    int64_t bad = -1;
    for (int64_t i = 0; i < n_ && bad < 0; ++i)
      if (!std::isfinite(w[static_cast<size_t>(i)])) bad = i;
    n_ = 0;
    if (by_stepper_) {
      window_.zero_();
      cursor_.zero_();
    }
    return {bad, bad >= 0 ? w[static_cast<size_t>(bad)] : 0.0, w.back() > 0};
  }

 private:
  Tensor window_;  // [steps + 1] float64: loss sums, then the stop votes
  Tensor cursor_;  // [1] int64: where a stepper appends the next sum
  int64_t steps_, n_ = 0;
  bool by_stepper_ = false;
};

// A loss is finite until the step after the update that broke the weights: a checkpoint checks
// them too, so none holds what only the next step would report. Every rank checks (the weights
// are the same everywhere), so all of them stop together.
void check_weights(Stepper& stepper, int64_t epoch, int64_t batch, int64_t step, const std::string& last_good) {
  const std::string bad = stepper.first_non_finite_weight();
  TANDEM_CHECK(bad.empty(), Value, "the weights are not finite at epoch ", epoch,
               batch >= 0 ? ", step " + std::to_string(batch) : std::string(" (its end)"), " (run step ", step,
               "; tensor '", bad, "'); stopping. ",
               last_good.empty() ? std::string("No checkpoint was written") : "The last good checkpoint: " + last_good);
}

}  // namespace

TrainResult run_training(const TrainConfig& cfg, const std::function<void(const EpochStats&)>& on_epoch) {
  TANDEM_CHECK(!cfg.devices.empty(), Value, "no devices given");
  TANDEM_CHECK(!cfg.group || cfg.devices.size() == 1, Value, "one device per process in a multi-process run, got ",
               cfg.devices.size());
  for (Device d : cfg.devices) check_device_exists(d);
  Device home = cfg.devices.front();  // data lives here; batches are split from here
  const bool reporting = reports(cfg);
  const bool bf16 = cfg.precision == "bf16";  // steps and evaluation under autocast (Note [autocast])
  CsvLog csv(reporting ? cfg.csv : "");  // fails before any work when the file cannot be written
  const bool checkpointing = !cfg.checkpoint_dir.empty();  // its folder was checked with the flags

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

  // Where the run starts: afresh, or where a checkpoint left it (docs/08-checkpoints.md).
  TrainResult result;
  int64_t start_epoch = 0, first_batch = 0, step = 0;  // start_epoch 0-based
  std::vector<double> resumed_counts;                  // loss_sum, correct, seen of a cut epoch
  if (cfg.resume) {
    nn::TrainingCheckpoint ck;
    std::string path;
    if (read_resume_checkpoint(cfg, ck, path)) {
      check_same_run(ck, cfg, path);
      stepper->load_state(ck, path);
      nn::restore_rng_states(ck);
      TANDEM_CHECK(ck.epoch_step <= train_loader.num_batches(), Value, path, ": epoch_step ", ck.epoch_step,
                   " is past the ", train_loader.num_batches(), " batches of an epoch");
      start_epoch = ck.epoch;
      first_batch = ck.epoch_step;
      step = ck.step;
      if (const Tensor* c = ck.extra.find("epoch_counts"); c != nullptr && first_batch > 0)
        resumed_counts = c->to_vector<double>();
      result.checkpoint = path;
      if (reporting)
        std::printf("resuming from %s: epoch %lld, step %lld of %lld (run step %lld)\n", path.c_str(),
                    static_cast<long long>(start_epoch + 1), static_cast<long long>(first_batch),
                    static_cast<long long>(train_loader.num_batches()), static_cast<long long>(step));
    } else if (reporting) {
      std::printf("no checkpoint in %s: starting afresh\n", cfg.checkpoint_dir.c_str());
    }
    std::fflush(stdout);
  }
  if (checkpointing) install_stop_handlers();
  const int64_t check_every = cfg.checkpoint_every > 0 ? cfg.checkpoint_every : kDefaultCheckEvery;
  LossWindow window(check_every, home);
  window.offer(*stepper);
  // The epoch's sums, the same tensors all run long (a stepper's CUDA graph adds to them in
  // place: Stepper::step), zeroed every epoch.
  const Tensor loss_sum = zeros({}, kFloat32, home);
  const Tensor correct = zeros({1}, kInt64, home);

  for (int64_t epoch = start_epoch + 1; epoch <= cfg.epochs; ++epoch) {
    const int64_t first = epoch == start_epoch + 1 ? first_batch : 0;
    if (train_sampler) train_sampler->set_epoch(epoch - 1);  // the same order as one process's epoch
    train_loader.set_epoch(epoch - 1, first);                // a resumed epoch continues at `first`
    loss_sum.zero_();
    correct.zero_();
    int64_t seen = 0;
    if (first > 0 && resumed_counts.size() == 3 && reporting) {
      // The cut epoch's sums so far (over the job: rank 0 holds them, the others add 0).
      loss_sum.fill_(resumed_counts[0]);
      correct.fill_(resumed_counts[1]);
      seen = static_cast<int64_t>(resumed_counts[2]);
    }
    // What a checkpoint of this epoch holds besides the model: the sums so far, over the job.
    auto save = [&](int64_t epoch0, int64_t batch) {
      check_weights(*stepper, epoch, batch, step, result.checkpoint);
      stepper->collect_metrics(correct);
      Tensor counts = epoch_counts(loss_sum, correct, seen);
      stepper->sum_across_processes(counts);
      nn::StateDict extra;
      extra.insert("epoch_counts", counts);
      result.checkpoint = write_checkpoint(cfg, *stepper, epoch0, batch, step, extra);
    };
    // Note [when the ranks look at the loss and the signals].
    auto check = [&](int64_t batch, bool stop_here) {
      const int64_t n = window.size();
      const auto [bad, value, stop] = window.check(*stepper, stop_here);
      TANDEM_CHECK(bad < 0, Value, "the loss is not finite at epoch ", epoch, ", step ", batch - n + 1 + bad,
                   " (run step ", step - n + 1 + bad, "; the epoch's loss sum is ", value, "); stopping. ",
                   result.checkpoint.empty() ? std::string("No checkpoint was written")
                                             : "The last good checkpoint: " + result.checkpoint);
      return stop;
    };
    stepper->set_lr(epoch_lr(cfg, epoch));
    Progress progress(train_loader.num_batches(), "epoch " + std::to_string(epoch));
    synchronize_all();
    auto t0 = std::chrono::steady_clock::now();
    train_loader.begin();  // the epoch's order, from batch `first`; the stepper gathers each batch
    int64_t batch = first;
    while (batch < train_loader.num_batches()) {
      const Tensor index = train_loader.batch_index(batch);
      {
        AutocastGuard autocast(kBFloat16, bf16);
        stepper->step(train_loader.dataset(), index, train_loader.global_batch_rows(batch), loss_sum, correct);
      }
      seen += index.size(0);
      ++batch;
      ++step;
      window.record(loss_sum);
      if (cfg.progress && reporting) progress.update(batch);
      const bool signalled = checkpointing && stop_signal() != 0;
      if (step % check_every != 0 && !(signalled && !cfg.group)) continue;
      const bool stop = check(batch, signalled);
      if (checkpointing && (stop || (cfg.checkpoint_every > 0 && step % cfg.checkpoint_every == 0)))
        save(epoch - 1, batch);
      if (stop) {
        progress.finish();
        result.stop_signal = stop_signal() != 0 ? stop_signal() : SIGTERM;  // another rank's
        result.epoch = epoch;
        result.epoch_step = batch;
        result.step = step;
        return result;
      }
    }
    if (window.size() > 0) check(batch, false);  // the epoch's last steps
    stepper->collect_metrics(correct);
    // The epoch's second and last host read, after the loss window's: the accumulated loss and
    // accuracy, summed over the processes of a job.
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
    if (cfg.evaluate) {
      AutocastGuard autocast(kBFloat16, bf16);
      s.test_acc = evaluate(*stepper, test_loader);
    }
    if (!cfg.trace.empty() && epoch == 1) stepper->write_trace(cfg.trace);  // every rank takes part
    csv.add(s);
    on_epoch(s);
  }
  // The end of the run writes a last checkpoint: all epochs done, nothing of an epoch pending.
  if (checkpointing) {
    check_weights(*stepper, cfg.epochs, -1, step, result.checkpoint);
    result.checkpoint = write_checkpoint(cfg, *stepper, cfg.epochs, 0, step, {});
  }
  result.epoch = cfg.epochs;
  result.step = step;
  return result;
}

}  // namespace tandem::examples
