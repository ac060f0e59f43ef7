#pragma once
// The training driver shared by the example programs and the benchmark: loads Fashion-MNIST,
// builds the model, trains it on one device, data-parallel on several, or as one process of a
// multi-process job (DistributedDataParallel), evaluates after every epoch, and reports each
// epoch (stdout line, CSV row, callback).
//
// In a job, every rank runs the same driver on its own device and its DistributedSampler's
// shard of each global batch; the numbers of an epoch (loss, train and test accuracy, images)
// are summed over the ranks, so each rank sees the job's numbers -- those of the one-process
// run on the same global batches when the world size divides the dataset (otherwise the
// padding the sampler repeats is counted too).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/report.h"
#include "core/device.h"
#include "nn/module.h"

namespace tandem::parallel::distributed {
class ProcessGroup;
}

namespace tandem::examples {

struct TrainConfig {
  std::function<std::shared_ptr<nn::Module>()> make_model;  // built on the CPU, moved by the driver
  std::string data_dir;
  std::vector<Device> devices;          // one entry: single-device training (or this rank's device)
  std::string parallel = "scratch";     // scratch | dp (several devices only) | pipeline
  // --parallel pipeline: the model's layers cut into one stage per device (or per process of a
  // job), each batch in micro_batches micro-batches, run by schedule (gpipe | 1f1b).
  int64_t micro_batches = 1;
  std::string schedule = "1f1b";
  // --balance: the layers of each stage, in order; empty: balance_by_parameters. balance_by says
  // how it was chosen: "parameters" or "time" (choose_pipeline_balance fills balance before the
  // stepper is made), or "" for a list given as it is.
  std::vector<int64_t> balance;
  std::string balance_by;
  Shape input_shape = {1, 28, 28};      // one image as the loader gives it (balance_by time's sample)
  std::string comm = "nccl";            // naive | ring | nccl (scratch path)
  int64_t epochs = 10;
  int64_t batch_size = 256;             // global batch, split across devices or processes
  std::string optimizer = "sgd";        // sgd | adam
  double lr = 0.9, momentum = 0.0, weight_decay = 0.0;
  std::string lr_schedule = "constant";  // constant | cosine (per epoch, from lr down towards 0)
  uint64_t seed = 0;
  int64_t train_limit = -1, test_limit = -1;
  bool evaluate = true;                 // test accuracy after each epoch
  bool drop_last = false;
  bool progress = true;
  std::string csv, trace;
  std::string model_name;               // what checkpoints record as config.model

  // Checkpoints (common/checkpoint.h): into checkpoint_dir every checkpoint_every steps (0:
  // only at the end and when a signal stops the run), the newest `keep` kept (0: all);
  // resume continues from resume_file, or (empty) from the newest in checkpoint_dir.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0, keep = 0;
  bool resume = false;
  std::string resume_file;

  // One process per device: distributed asks for it (the program then builds `group` from the
  // launcher's environment with `backend`: auto | nccl | gloo); group set means this process
  // is one rank of that job and trains through DistributedDataParallel on devices.front().
  bool distributed = false;
  std::string backend = "auto";
  std::shared_ptr<parallel::distributed::ProcessGroup> group;
  double bucket_cap_mb = 25.0;          // DDP's bucket size (and ZeRO-2's)
  // --zero: the job's state sharded (0: DDP). 1: ZeroRedundancyOptimizer stage 1 beside DDP,
  // 2: stage 2 on the bare module, 3: FullyShardedDataParallel (zero_stepper.cpp).
  int zero = 0;
  bool overlap = true;                  // false: DDP reduces after backward (for measurements)
  bool cuda_graph = true;               // GPUs of this process: the step in a CUDA graph per GPU (core/cuda_graph.h)
  bool channels_last = false;           // 4-D weights, and so activations, channels-last (Note [memory formats])
  std::string precision = "fp32";       // bf16: training and evaluation under autocast (autograd/autocast.h)
};

// Whether this process reports (prints, draws the progress bar, writes the CSV): the one
// process of a single-process run, or rank 0 of a job.
bool reports(const TrainConfig& cfg);

// How a run ended without an error: all epochs done, or stopped by a signal after writing a
// checkpoint.
struct TrainResult {
  int stop_signal = 0;        // SIGINT or SIGTERM when a signal stopped the run, else 0
  int64_t epoch = 0, epoch_step = 0, step = 0;  // where it stopped (epoch 1-based)
  std::string checkpoint;     // the last checkpoint written ("" when none)
};

// Runs the whole training (from a checkpoint with cfg.resume); calls on_epoch after each epoch
// -- on every rank of a job, with the job's numbers -- and writes the CSV where reports(cfg).
// With cfg.checkpoint_dir, SIGINT/SIGTERM stop it after the current step (in a job: at the next
// check, Note [when the ranks look at the loss and the signals] in train.cpp) with a
// checkpoint. Throws tandem::Error on failure, including a loss that is not finite (naming the
// epoch and step; the checkpoints written before it are kept).
TrainResult run_training(const TrainConfig& cfg, const std::function<void(const EpochStats&)>& on_epoch);

// The learning rate of epoch `epoch` (1-based) of cfg.epochs: cfg.lr, or with "cosine"
// lr * (1 + cos(pi * (epoch - 1) / epochs)) / 2 (lr in the first epoch, lr/2 halfway).
double epoch_lr(const TrainConfig& cfg, int64_t epoch);

// Default device list for a program: every GPU's first when there is one, else the CPU.
std::vector<Device> default_devices();

}  // namespace tandem::examples
