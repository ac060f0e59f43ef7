#include "common/cli.h"

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <stdexcept>

#include "common/checkpoint.h"
#include "common/stepper.h"

#include "autograd/anomaly.h"
#include "core/error.h"
#include "data/fashion_mnist.h"
#include "nn/container.h"
#include "parallel/device_api.h"
#include "parallel/distributed/env.h"
#include "parallel/distributed/process_group.h"
#include "parallel/pipeline/split.h"
#include "nn/sync_batchnorm.h"

namespace tandem::examples {

namespace {

// A device flag that does not parse is a bad flag (exit code 2), like any other.
std::vector<Device> parse_devices_flag(const Args& args) {
  try {
    if (args.given("devices")) return parse_device_list(args.str("devices"));
    if (args.given("device")) return {Device::parse(args.str("device"))};
  } catch (const ValueError& e) {
    throw ArgsError(std::string("--") + (args.given("devices") ? "devices" : "device") + ": " + e.what());
  }
  return default_devices();
}

// One process per device: the process's device from --device and --backend. Each process takes
// its LOCAL_RANK's GPU when there are GPUs (nccl), else -- or with --device cpu -- the CPU
// (gloo); the flags that choose devices inside one process do not apply.
void configure_distributed(const Args& args, TrainConfig& cfg) {
  for (const char* name : {"devices", "parallel", "comm"})
    if (args.given(name) && !(std::string(name) == "parallel" &&
                              (args.str("parallel") == "pipeline" || args.str("parallel") == "tensor"))) {
      throw ArgsError(std::string("--") + name + " is for one process; in a multi-process run each process "
                      "takes one device (LOCAL_RANK's GPU, or the CPU with --device cpu)");
    }
  cfg.backend = args.choice("backend", {"auto", "nccl", "gloo"});
  const std::string device = args.str("device");
  if (!device.empty() && device != "cpu" && device != "cuda")
    throw ArgsError("--device: a multi-process run takes cpu or cuda (each process uses cuda:LOCAL_RANK), got '" +
                    device + "'");
  const bool gpu = device == "cuda" || (device.empty() && cfg.backend != "gloo" && cuda_available());
  if (gpu && cfg.backend == "gloo") throw ArgsError("--backend gloo moves CPU tensors; a GPU takes nccl");
  if (!gpu && cfg.backend == "nccl") throw ArgsError("--backend nccl needs a GPU per process; the CPU takes gloo");
  cfg.devices = {gpu ? Device::cuda(parallel::distributed::read_dist_env().local_rank) : kCPU};
  if (cfg.backend == "auto") cfg.backend = gpu ? "nccl" : "gloo";
  cfg.bucket_cap_mb = args.real("bucket-cap-mb", 1e-3, 1e5);
  cfg.overlap = !args.on("no-overlap");
  if (args.given("parallel")) cfg.parallel = args.str("parallel");  // a stage, or a shard, per process
}

// --zero: the state of a data-parallel job sharded over its processes. Only the processes of a
// job hold shards, one device each, and a pipeline's or a tensor split's stages hold different
// layers, not replicas: each bad combination is one ArgsError.
void configure_zero(const Args& args, TrainConfig& cfg) {
  if (!args.given("zero")) return;
  const std::string v = args.str("zero");
  if (v != "1" && v != "2" && v != "3")
    throw ArgsError("--zero: '" + v + "' is not a stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters, FSDP)");
  cfg.zero = std::stoi(v);
  if (args.given("parallel") && args.str("parallel") != "scratch" && args.str("parallel") != "dp")
    throw ArgsError("--zero shards a data-parallel job's state; --parallel " + args.str("parallel") +
                    " splits the model's layers instead (give one or the other)");
  if (args.given("devices"))
    throw ArgsError("--zero shards the state over the processes of a job, one device each; --devices is for "
                    "one process");
  if (!cfg.distributed)
    throw ArgsError("--zero " + v + " shards the state over the processes of a job: run under a launcher "
                    "(tandem-run --nproc-per-node N ...) or with --distributed");
}

// --balance parameters|time|N,N,...: how the layers are cut into stages. A list must be whole
// numbers of at least one layer each; whether it has a stage per device and adds up to the
// model's layers is checked in check_pipeline_model.
void parse_balance(const std::string& v, TrainConfig& cfg) {
  if (v == "parameters" || v == "time") {
    cfg.balance_by = v;
    return;
  }
  std::vector<int64_t> balance;
  for (size_t at = 0;;) {
    const size_t comma = std::min(v.find(',', at), v.size());
    const std::string item = v.substr(at, comma - at);
    const std::optional<int64_t> n = parse_integer(item);
    if (!n) throw ArgsError("--balance: '" + v + "' is not parameters, time or a list of layer counts such as 7,5");
    balance.push_back(*n);
    if (comma == v.size()) break;
    at = comma + 1;
  }
  for (size_t s = 0; s < balance.size(); ++s)
    if (balance[s] < 1)
      throw ArgsError("--balance " + v + ": stage " + std::to_string(s) + " gets " + std::to_string(balance[s]) +
                      " layers; every stage needs at least one");
  cfg.balance = balance;
}

// --parallel pipeline's flags (the model's layers are checked in check_pipeline_model, once
// the program has said what its model is). Each bad combination is one ArgsError.
void configure_pipeline(const Args& args, TrainConfig& cfg) {
  if (cfg.parallel == "tensor") {
    for (const char* name : {"checkpoint", "resume", "detect-anomaly", "trace"})
      if (args.given(name)) throw ArgsError(std::string("--") + name + " is not supported with --parallel tensor yet");
    if (cfg.precision != "fp32")
      throw ArgsError("--precision " + cfg.precision + " is not supported with --parallel tensor yet");
  }
  if (cfg.parallel != "pipeline") {
    for (const char* name : {"micro-batches", "schedule", "balance"})
      if (args.given(name)) throw ArgsError(std::string("--") + name + " is for --parallel pipeline");
    return;
  }
  cfg.micro_batches = args.integer("micro-batches", 1, 1 << 20);
  cfg.schedule = args.choice("schedule", {"gpipe", "1f1b"});
  if (cfg.micro_batches > cfg.batch_size)
    throw ArgsError("--micro-batches " + std::to_string(cfg.micro_batches) + " is larger than --batch-size " +
                    std::to_string(cfg.batch_size) + " (a micro-batch would be empty)");
  if (args.given("balance")) parse_balance(args.str("balance"), cfg);
  for (const char* name : {"checkpoint", "resume", "detect-anomaly"})
    if (args.given(name)) throw ArgsError(std::string("--") + name + " is not supported with --parallel pipeline yet");
  if (cfg.precision != "fp32")
    throw ArgsError("--precision " + cfg.precision + " is not supported with --parallel pipeline yet");
}

// More stages than the model has layers is a bad flag too: the stages are the devices of this
// process, or the processes of the job.
void check_pipeline_model(const TrainConfig& cfg, const std::string& description) {
  if (cfg.parallel == "tensor") {
    auto model = std::dynamic_pointer_cast<nn::SequentialImpl>(cfg.make_model());
    const int64_t n = cfg.distributed ? parallel::distributed::read_dist_env().world_size
                                      : static_cast<int64_t>(cfg.devices.size());
    if (!model || tensor_parallel_split_point(*model, n) < 0)
      throw ArgsError("--parallel tensor: " + description + " has no Linear -> ReLU/Sigmoid -> Linear whose " +
                      std::to_string(n) + (cfg.distributed ? " processes" : " devices") +
                      " each get at least one feature of the middle");
    return;
  }
  if (cfg.parallel != "pipeline") return;
  auto model = std::dynamic_pointer_cast<nn::SequentialImpl>(cfg.make_model());
  if (!model) throw ArgsError("--parallel pipeline cuts a Sequential into stages; " + description + " is not one");
  const int64_t stages =
      cfg.distributed ? parallel::distributed::read_dist_env().world_size : static_cast<int64_t>(cfg.devices.size());
  if (stages > static_cast<int64_t>(model->size()))
    throw ArgsError("--parallel pipeline: " + std::to_string(stages) + (cfg.distributed ? " processes" : " devices") +
                    " for " + std::to_string(model->size()) + " layers; every stage needs at least one layer");
  if (cfg.balance.empty()) return;
  std::string list;
  int64_t total = 0;
  for (int64_t n : cfg.balance) {
    list += (list.empty() ? "" : ",") + std::to_string(n);
    total += n;
  }
  if (static_cast<int64_t>(cfg.balance.size()) != stages)
    throw ArgsError("--balance " + list + " has " + std::to_string(cfg.balance.size()) + " stages but there are " +
                    std::to_string(stages) + (cfg.distributed ? " processes" : " devices"));
  if (total != static_cast<int64_t>(model->size()))
    throw ArgsError("--balance " + list + " adds up to " + std::to_string(total) + " layers but " + description +
                    " has " + std::to_string(model->size()));
}

// ", balance [7, 5] by time" when --balance chose the stages; "" otherwise (the header line of
// a run without the flag stays what it was).
std::string balance_note(const TrainConfig& cfg) {
  if (cfg.balance.empty()) return "";
  return ", balance " + parallel::pipeline::balance_str(cfg.balance) +
         (cfg.balance_by == "time" ? " by time" : cfg.balance_by == "parameters" ? " by parameter count" : "");
}

// "cuda:0", "cpu:0,cpu:1 [scratch/ring]", "2 processes (gloo, cpu)", "2 processes (nccl, one GPU each)".
std::string where(const TrainConfig& cfg) {
  if (cfg.group) {
    const int n = cfg.group->size();
    const Device d = cfg.devices.front();
    return std::to_string(n) + (n == 1 ? " process (" : " processes (") + cfg.group->backend() + ", " +
           (d.is_cpu() ? "cpu" : n == 1 ? d.str() : "one GPU each") + ")" +
           (cfg.zero == 0 ? "" : cfg.zero == 3 ? " [ZeRO-3: FSDP]" : " [ZeRO-" + std::to_string(cfg.zero) + "]") +
           (cfg.parallel == "pipeline" ? " [pipeline " + cfg.schedule + ", " + std::to_string(cfg.micro_batches) +
                                             " micro-batches, a stage per process" + balance_note(cfg) + "]"
            : cfg.parallel == "tensor" ? " [tensor, a shard per process]"
                                       : "");
  }
  std::string devs;
  for (Device d : cfg.devices) devs += (devs.empty() ? "" : ",") + d.str();
  if (cfg.parallel == "pipeline")
    return devs + " [pipeline " + cfg.schedule + ", " + std::to_string(cfg.micro_batches) + " micro-batches" +
           balance_note(cfg) + "]";
  if (cfg.devices.size() < 2) return devs;
  return devs + " [" + cfg.parallel + (cfg.parallel == "scratch" ? "/" + cfg.comm : "") + "]";
}

}  // namespace

void add_common_flags(Args& args) {
  args.option("data", data::kFashionMnistDefaultDir, "folder with the Fashion-MNIST IDX files (.gz or raw)");
  args.option("device", "", "one device: cpu, cuda, cuda:N (default: a GPU if present, else cpu)");
  args.option("devices", "", "several devices, e.g. cuda:0,cuda:1 or cpu:0,cpu:1 (data-parallel); cuda:0*2: two "
                             "devices on one GPU");
  args.option("parallel", "scratch", "with several devices: scratch|dp (data-parallel) or pipeline (the layers cut "
                                     "into a stage per device, or per process under a launcher) or tensor (a Linear -> activation -> Linear split "
                                     "over the devices, or over the processes under a launcher)");
  args.option("micro-batches", "1", "--parallel pipeline: micro-batches per batch");
  args.option("schedule", "1f1b", "--parallel pipeline: gpipe|1f1b");
  args.option("balance", "parameters", "--parallel pipeline: the layers per stage: parameters (the largest stage's "
                                       "parameter count as small as it can be), time (its measured forward + "
                                       "backward time; measured before training) or a list such as 7,5");
  args.option("comm", "nccl", "gradient allreduce of the scratch path: naive|ring|nccl (nccl: GPUs only; "
                              "ring on CPU devices and on devices that share a GPU)");
  args.option("epochs", "10", "training epochs");
  args.option("batch-size", "256", "global minibatch size, split across devices or processes (not per process as "
                                   "in PyTorch's DDP tutorials)");
  args.option("lr", "", "learning rate");
  args.option("lr-schedule", "constant", "constant|cosine (cosine: per epoch, from --lr down towards 0)");
  args.option("optimizer", "sgd", "sgd|adam");
  args.option("momentum", "0", "SGD momentum");
  args.option("weight-decay", "0", "L2 weight decay");
  args.option("seed", "0", "seed for initialization and shuffling");
  args.option("train-limit", "-1", "use only the first N training images (-1: all)");
  args.option("test-limit", "-1", "use only the first N test images (-1: all)");
  args.option("csv", "", "write one row per epoch to this CSV file");
  args.option("trace", "", "write a Chrome-trace timeline (Perfetto) of the first steps (several devices, or every rank of a multi-process run, merged)");
  args.flag("no-progress", "never draw the progress bar");
  args.option("checkpoint", "", "write training checkpoints into this folder (at the end, every --checkpoint-every "
                                "steps, and when SIGINT/SIGTERM stop the run)");
  args.option("checkpoint-every", "0", "steps between checkpoints (0: only at the end and on a signal)");
  args.option("keep", "", "keep only the K newest checkpoints (default: all)");
  args.optional_value("resume", "continue from FILE, or alone from the newest whole checkpoint in --checkpoint "
                                "(a fresh start, said so, when there is none)");
  args.flag("detect-anomaly", "stop at the first op whose output or gradient holds a NaN or Inf, naming it "
                              "(slow: checks every op; one device per process)");
  args.flag("distributed", "one process per device, DDP (implied under tandem-run, torchrun, mpirun or srun)");
  args.option("backend", "auto", "multi-process: auto|nccl|gloo (auto: nccl on GPUs, gloo on the CPU)");
  args.option("bucket-cap-mb", "25", "multi-process: DDP's (and --zero 2's) gradient bucket size in MB");
  args.option("zero", "", "multi-process: shard the training state over the processes (ZeRO): 1 the optimizer "
                          "state (beside DDP), 2 + the gradients, 3 + the parameters (FSDP)");
  args.flag("no-overlap", "multi-process: reduce the gradients after backward, not during it (to measure)");
  args.flag("sync-bn", "multi-process: batch norm with the statistics of the global batch (SyncBatchNorm: every "
                      "BatchNorm2d converted)");
  args.flag("no-cuda-graph", "GPUs of one process: launch every kernel of a step from the host instead of "
            "replaying captured CUDA graphs (one per GPU)");
  args.option("precision", "fp32", "fp32 | bf16: bf16 runs convolutions and matrix products in bfloat16 under "
                                   "autocast, with float32 weights, optimizer state and loss");
  args.flag("channels-last", "lay out 4-D weights and activations channels-last (NHWC), the layout of cuDNN's "
            "tensor-core convolutions");
}

void configure_common(const Args& args, TrainConfig& cfg) {
  cfg.distributed = args.on("distributed") || parallel::distributed::launched_by_launcher();
  configure_zero(args, cfg);
  if (cfg.distributed) {
    configure_distributed(args, cfg);
  } else {
    for (const char* name : {"backend", "bucket-cap-mb", "no-overlap", "sync-bn"})
      if (args.given(name))
        throw ArgsError(std::string("--") + name + " is for a multi-process run (under a launcher, or with --distributed)");
    if (args.given("devices") && args.given("device")) throw ArgsError("give --device or --devices, not both");
    cfg.devices = parse_devices_flag(args);
    cfg.parallel = args.choice("parallel", {"scratch", "dp", "pipeline", "tensor"});
    cfg.comm = args.choice("comm", {"naive", "ring", "nccl"});
    if (!args.given("comm") && (cfg.devices.front().is_cpu() || parallel::shares_a_gpu(cfg.devices)))
      cfg.comm = "ring";
  }
  cfg.data_dir = args.str("data");
  cfg.cuda_graph = !args.on("no-cuda-graph");
  cfg.channels_last = args.on("channels-last");
  cfg.precision = args.choice("precision", {"fp32", "bf16"});
  cfg.epochs = args.integer("epochs", 1, 100000);
  cfg.batch_size = args.integer("batch-size", 1, 1 << 20);
  cfg.optimizer = args.choice("optimizer", {"sgd", "adam"});
  cfg.lr_schedule = args.choice("lr-schedule", {"constant", "cosine"});
  cfg.momentum = args.real("momentum", 0.0, 1.0);
  cfg.weight_decay = args.real("weight-decay", 0.0, 1.0);
  cfg.seed = static_cast<uint64_t>(args.integer("seed", 0));
  cfg.train_limit = args.integer("train-limit", -1);
  cfg.test_limit = args.integer("test-limit", -1);
  if (cfg.train_limit == 0 || cfg.test_limit == 0) throw ArgsError("--train-limit and --test-limit must be -1 or >= 1");
  cfg.csv = args.str("csv");
  cfg.trace = args.str("trace");
  if (!cfg.trace.empty() && !cfg.distributed && cfg.devices.size() < 2)
    throw ArgsError("--trace needs several --devices (or one process per device)");
  cfg.progress = !args.on("no-progress");
  configure_pipeline(args, cfg);

  cfg.checkpoint_dir = args.str("checkpoint");
  cfg.checkpoint_every = args.integer("checkpoint-every", 0);
  if (args.given("keep")) cfg.keep = args.integer("keep", 1);
  cfg.resume = args.given("resume");
  cfg.resume_file = args.str("resume");
  if (cfg.checkpoint_dir.empty()) {
    for (const char* name : {"checkpoint-every", "keep"})
      if (args.given(name)) throw ArgsError(std::string("--") + name + " needs --checkpoint DIR");
    if (cfg.resume && cfg.resume_file.empty())
      throw ArgsError("--resume without a file needs --checkpoint DIR (the folder to continue from)");
  }
  if (!cfg.resume_file.empty() && !std::filesystem::is_regular_file(cfg.resume_file))
    throw ArgsError("--resume " + cfg.resume_file + ": no such file");
  if (!cfg.checkpoint_dir.empty()) {
    try {
      check_checkpoint_dir(cfg.checkpoint_dir);  // before any training: a folder that takes files
    } catch (const std::runtime_error& e) {
      throw ArgsError(e.what());
    }
  }
}

parallel::distributed::DistributedContext start_process_group(TrainConfig& cfg) {
  parallel::distributed::DistributedContext ctx;
  if (cfg.distributed) {
    // One rank of a job: the launcher's environment says who we are (torch's init_process_group).
    ctx = parallel::distributed::init_process_group(cfg.backend, cfg.devices.front());
    cfg.group = ctx.group;
  }
  return ctx;
}

int train_main(int argc, char** argv, const ProgramSpec& spec) {
  Args args(spec.name, spec.summary);
  add_common_flags(args);
  if (spec.add_flags) spec.add_flags(args);
  try {
    if (!args.parse(argc, argv)) {
      std::fputs(args.help().c_str(), stdout);
      return 0;
    }
    TrainConfig cfg;
    configure_common(args, cfg);
    std::string description;
    spec.configure(args, cfg, description);
    cfg.model_name = description;
    check_pipeline_model(cfg, description);
    if (args.given("lr")) cfg.lr = args.real("lr", 0.0, 1e6);
    else if (cfg.optimizer == "adam") cfg.lr = 1e-3;
    for (Device d : cfg.devices) check_device_exists(d);
    // Anomaly mode is per thread (autograd/anomaly.h): it covers this thread's forward and backward,
    // which is the whole step with one device per process.
    if (args.on("detect-anomaly") && cfg.devices.size() > 1)
      throw ArgsError("--detect-anomaly checks one thread's ops: give one --device (or one process per device)");
    std::optional<autograd::DetectAnomalyGuard> anomaly;
    if (args.on("detect-anomaly")) {
      anomaly.emplace();
      cfg.cuda_graph = false;  // the checks read values on the host, which a graph capture forbids
    }

    parallel::distributed::DistributedContext ctx = start_process_group(cfg);
    if (args.on("sync-bn")) {
      // The group exists only now: the model factory converts what the program's builds.
      cfg.make_model = [make = cfg.make_model, group = cfg.group] {
        return nn::convert_sync_batchnorm(make(), group);
      };
      description += ", SyncBatchNorm";
    }
    // --balance parameters|time: chosen once, the same on every rank, before the header names it.
    if (!cfg.balance_by.empty()) cfg.balance = choose_pipeline_balance(cfg);
    // Only one process speaks: the only one, or rank 0 of the job (the numbers are the job's).
    const bool speak = reports(cfg);
    if (speak) {
      std::printf("%s on %s, batch %lld%s, %s lr %g%s%s%s\n", description.c_str(), where(cfg).c_str(),
                  static_cast<long long>(cfg.batch_size), cfg.group ? " (global)" : "", cfg.optimizer.c_str(), cfg.lr,
                  cfg.lr_schedule == "cosine" ? " (cosine)" : "", cfg.precision == "bf16" ? ", bf16 autocast" : "",
                  cfg.channels_last ? ", channels-last" : "");
      std::fflush(stdout);
    }
    const TrainResult result = run_training(cfg, [speak](const EpochStats& s) {
      if (!speak) return;
      std::printf("%s\n", format_epoch(s).c_str());
      std::fflush(stdout);
    });
    if (result.stop_signal != 0) {
      // 128 + the signal, as a shell reports a process the signal ended.
      if (speak)
        std::fprintf(stderr, "%s: stopped by %s at epoch %lld, step %lld (run step %lld); checkpoint %s; "
                     "continue with the same flags and --resume\n", spec.name.c_str(),
                     result.stop_signal == SIGINT ? "SIGINT" : "SIGTERM", static_cast<long long>(result.epoch),
                     static_cast<long long>(result.epoch_step), static_cast<long long>(result.step),
                     result.checkpoint.c_str());
      return 128 + result.stop_signal;
    }
    if (!cfg.trace.empty() && speak) std::printf("timeline written to %s (open it in ui.perfetto.dev)\n", cfg.trace.c_str());
    return 0;
  } catch (const ArgsError& e) {
    std::fprintf(stderr, "%s: %s\n", spec.name.c_str(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", spec.name.c_str(), e.what());
    return 1;
  }
}

}  // namespace tandem::examples
