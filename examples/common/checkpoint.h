#pragma once
// Checkpoints of a training program: the files in --checkpoint DIR, which one --resume picks,
// and the signals that stop a run cleanly. The file itself is nn::TrainingCheckpoint (Note
// [training checkpoint names] in nn/serialize_checkpoint.h); docs/08-checkpoints.md tells the
// whole story.
//
// Note [checkpoint file names]: DIR/ckpt-<step, 12 digits>.safetensors, so that names sort by
// step. write_file_atomic's temporary files start with '.' and end in ".tmp.<pid>.<n>": they
// never match, so a file that is being written (or was, when the process died) is never
// picked; a name that matches is a whole file. --resume still reads the newest and falls back
// to the one before when it does not validate (a disk that lost data), saying so.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/stepper.h"
#include "common/train.h"
#include "nn/serialize_checkpoint.h"

namespace tandem::examples {

// "ckpt-000000000042.safetensors" for step 42.
std::string checkpoint_file_name(int64_t step);
// The checkpoints in dir, oldest first: (step, path) of every file named as above.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& dir);

// Creates dir when missing and checks that it takes files (writes and removes a probe);
// std::runtime_error naming the folder and the OS reason otherwise.
void check_checkpoint_dir(const std::string& dir);

// What --resume continues from: cfg.resume_file, or the newest checkpoint in
// cfg.checkpoint_dir that reads back whole (a note on stderr for each one skipped). Returns
// false, having read nothing, when the folder holds none.
bool read_resume_checkpoint(const TrainConfig& cfg, nn::TrainingCheckpoint& out, std::string& path);

// Throws ValueError naming the key when ckpt was written by a run whose batches differ from
// cfg's (batch size, seed, --train-limit, drop_last): resuming it would not continue that run.
void check_same_run(const nn::TrainingCheckpoint& ckpt, const TrainConfig& cfg, const std::string& path);

// The configuration a checkpoint records (config.<key>).
nn::Metadata run_config(const TrainConfig& cfg);

// The name of the first floating tensor of model's state_dict that holds a NaN or Inf, or ""
// (reads every tensor to the host: for checkpoints, not for every step).
std::string first_non_finite(const nn::Module& model);

// Writes the stepper's state at (epoch, epoch_step, step) plus `extra` to
// cfg.checkpoint_dir/checkpoint_file_name(step) and removes all but the cfg.keep newest (0:
// keeps all). In a job rank 0 writes, and every rank returns only once the file is in place
// (a barrier). Returns the path.
std::string write_checkpoint(const TrainConfig& cfg, Stepper& stepper, int64_t epoch, int64_t epoch_step,
                             int64_t step, const nn::StateDict& extra);

// SIGINT and SIGTERM from now on only set a flag (a second one ends the process at once).
void install_stop_handlers();
// The signal that asked the run to stop, or 0.
int stop_signal();

}  // namespace tandem::examples
