#pragma once
// The training checkpoint: everything a run needs to continue exactly where it stopped, in one
// safetensors file (nn/serialize.h), so PyTorch's `safetensors` opens it too.
//
// Note [training checkpoint names]: the file holds
//   model.<name>                 the model's state_dict ("model.0.weight", ...; BatchNorm's
//                                running statistics and num_batches_tracked included)
//   optimizer.state.<i>.<name>   the optimizer's state_dict (Note [optimizer state names] in
//                                nn/optim/optimizer.h): momentum_buffer, or step, exp_avg and
//                                exp_avg_sq, for parameter i in the optimizer's order
//   rng_state.<device>           the default Generator's get_state() of each device the run
//                                uses ("rng_state.cpu:0", "rng_state.cuda:0"), uint8 [2504]
//   extra.<name>                 tensors of the program's own (e.g. an epoch's running sums)
// and the metadata (strings)
//   tandem.kind = "training_checkpoint"
//   epoch       the epoch in progress, 0-based (after the last step of epoch e: e + 1, step 0)
//   epoch_step  the optimizer steps taken in that epoch: the batch to continue with
//   step        the optimizer steps taken in the whole run
//   config.<key>  the run's configuration (flags, model, devices), for the reader and for a
//                 resume to check that it continues the same run
// The data order needs no tensor: an epoch's shuffled order is a function of the loader's seed
// and the epoch (Note [epoch seeding] in data/dataloader.h), so (epoch, epoch_step) is the
// whole DataLoader state; a program keeps its seed under config.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/device.h"
#include "nn/module.h"
#include "nn/optim/optimizer.h"
#include "nn/serialize.h"

namespace tandem::nn {

struct TrainingCheckpoint {
  StateDict model, optimizer;
  std::map<std::string, Tensor> rng_states;  // device name ("cpu:0", "cuda:0") -> state
  StateDict extra;
  int64_t epoch = 0, epoch_step = 0, step = 0;
  Metadata config;  // keys without the "config." prefix
};

// A checkpoint of the run's current state: module.state_dict(), optimizer.state_dict() and the
// default generators of `devices` (live tensors: write it before the next step).
TrainingCheckpoint capture_training_state(const Module& module, const optim::Optimizer& optimizer,
                                          const std::vector<Device>& devices);

// Writes ckpt atomically to path (write_file_atomic: a crash leaves the old file or the new
// one, and the temporary name starts with '.'). ValueError for a negative epoch or step.
void save_training_checkpoint(const std::string& path, const TrainingCheckpoint& ckpt);

// Reads and validates a training checkpoint (read_safetensors' checks first, so sizes in the
// header are never trusted). FormatError naming the file and the key for a file that is not a
// training checkpoint (no tandem.kind, or another), a missing or non-integer epoch /
// epoch_step / step, or a tensor outside the four groups above.
TrainingCheckpoint read_training_checkpoint(const std::string& path);

// Copies ckpt's model and optimizer state into `module` and `optimizer`: load_checked (names
// the first offending "model.<name>" tensor) then Optimizer::load_state_dict. Nothing in the
// module changes when its tensors do not fit; `source` starts the messages.
void load_training_state(const TrainingCheckpoint& ckpt, Module& module,
                         optim::Optimizer& optimizer, const std::string& source);

// Sets each default generator named in ckpt.rng_states (ValueError for a device name that does
// not parse).
void restore_rng_states(const TrainingCheckpoint& ckpt);

}  // namespace tandem::nn
