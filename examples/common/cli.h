#pragma once
// The command line shared by the training programs: the common flags, their validation, and a
// main() body that turns every error into one line on stderr and a non-zero exit code
// (2 for bad flags, 1 for anything else). --batch-size is the global batch in every mode.
#include <functional>
#include <memory>
#include <string>

#include "common/args.h"
#include "common/train.h"
#include "parallel/distributed/process_group.h"

namespace tandem::examples {

struct ProgramSpec {
  std::string name, summary;
  // Declares the program's own flags (e.g. --activation).
  std::function<void(Args&)> add_flags;
  // Builds the model factory, the default learning rate and a description from the parsed flags.
  std::function<void(const Args&, TrainConfig&, std::string& description)> configure;
};

int train_main(int argc, char** argv, const ProgramSpec& spec);

// The flags every training program shares (data, devices, parallel path, optimizer, limits,
// CSV, trace, checkpoints: --checkpoint, --checkpoint-every, --keep, --resume [FILE], and the
// multi-process ones: --distributed, --backend, --bucket-cap-mb, --no-overlap, --sync-bn) and their
// validation into a TrainConfig; ArgsError for a bad value (a --checkpoint folder that cannot
// take files is one, before any training). Under a
// launcher (parallel/distributed/env.h: launched_by_launcher) or with --distributed the run is one
// process per device: --devices, --parallel, --comm and --trace are then bad flags, --device
// takes cpu or cuda (cuda: this process's cuda:LOCAL_RANK), and train_main builds the process
// group, so that rank 0 alone prints the job's numbers.
void add_common_flags(Args& args);
void configure_common(const Args& args, TrainConfig& cfg);

// In a multi-process run (cfg.distributed): joins the job (the store, the process group) and
// sets cfg.group; otherwise returns an empty context. Keep the context alive while training.
parallel::distributed::DistributedContext start_process_group(TrainConfig& cfg);

}  // namespace tandem::examples
