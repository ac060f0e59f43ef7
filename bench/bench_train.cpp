// Times training epochs of tandem the way bench/torch_*.py times PyTorch: data already on the
// device, batch 256 per step, drop_last, no evaluation; the first epoch is a warm-up (cuDNN
// algorithm search, pool growth) and the median of the rest is reported. Prints one JSON line.
//
//   bench_train --model lenet|resnet18 --devices cuda:0[,cuda:1] [--parallel scratch|dp]
//               [--comm nccl|ring|naive] [--epochs 5] [--batch-size 256] [--train-limit N]
// (the flags of the training programs; see --help)
#include <algorithm>
#include <cstdio>
#include <vector>

#include "common/cli.h"
#include "data/fashion_mnist.h"
#include "core/allocator.h"
#include "kernels/backend.h"
#include "nn/models/lenet.h"
#include "nn/models/resnet.h"

using namespace tandem;
using namespace tandem::examples;

int main(int argc, char** argv) {
  Args args("bench_train", "Times training epochs; prints one JSON line.");
  add_common_flags(args);
  args.option("model", "lenet", "lenet|resnet18");
  try {
    if (!args.parse(argc, argv)) {
      std::fputs(args.help().c_str(), stdout);
      return 0;
    }
    TrainConfig cfg;
    configure_common(args, cfg);
    std::string model = args.choice("model", {"lenet", "resnet18"});
    cfg.make_model = [model]() -> std::shared_ptr<nn::Module> {
      Generator gen(0);
      if (model == "lenet") return nn::models::lenet({}, gen);
      return nn::models::resnet18(10, 1, gen);
    };
    if (!args.given("epochs")) cfg.epochs = 5;
    if (cfg.epochs < 2) throw ArgsError("--epochs: the first epoch is a warm-up; give at least 2");
    cfg.lr = args.given("lr") ? args.real("lr", 0, 100) : (model == "lenet" ? 0.9 : 0.05);
    if (!args.given("test-limit")) cfg.test_limit = 1000;
    // Under a launcher: one rank of a DDP job (tandem-run --nproc-per-node N bench_train ...).
    parallel::distributed::DistributedContext ctx = start_process_group(cfg);
    cfg.evaluate = false;
    cfg.drop_last = true;
    cfg.progress = false;
    std::vector<double> times;
    double acc = 0, ips = 0;
    int64_t images = 0;
    run_training(cfg, [&](const EpochStats& s) {
      times.push_back(s.seconds);
      acc = s.train_acc;
      images = static_cast<int64_t>(s.images_per_s * s.seconds + 0.5);
      if (reports(cfg)) std::fprintf(stderr, "epoch %lld: %.4f s, train acc %.4f\n", static_cast<long long>(s.epoch), s.seconds, s.train_acc);
    });
    std::vector<double> timed(times.begin() + 1, times.end());
    std::sort(timed.begin(), timed.end());
    double median = timed[timed.size() / 2];
    if (timed.size() % 2 == 0) median = 0.5 * (timed[timed.size() / 2 - 1] + timed[timed.size() / 2]);
    ips = images / median;
    std::string ddp_variant = cfg.overlap ? "" : ",no-overlap";
    if (cfg.bucket_cap_mb != 25.0) ddp_variant += ",cap" + std::to_string(static_cast<int>(cfg.bucket_cap_mb));
    if (cfg.group && cfg.group->options().high_priority_stream) ddp_variant += ",hi-prio";
    std::string path = cfg.group ? "ddp/" + cfg.group->backend() + ddp_variant
                       : cfg.devices.size() == 1
                           ? (cfg.cuda_graph && cfg.devices.front().is_cuda() ? "graph" : "eager")
                                                 : cfg.parallel + (cfg.parallel == "scratch" ? "/" + cfg.comm : "");
    if (cfg.channels_last) path += "+cl";
    if (cfg.precision == "bf16") path += "+bf16";
    if (!fuse_bn_relu()) path += "-bnrelu";  // Note [batch norm + ReLU]
    if (!fuse_conv_bias()) path += "-convbias";  // Note [conv bias in batch norm]
    if (cfg.devices.front().is_cuda() && cudnn_benchmark()) path += "+bench";
    if (cfg.devices.front().is_cuda() && !cudnn_deterministic()) path += "+nondet";
    const size_t devices = cfg.group ? static_cast<size_t>(cfg.group->size()) : cfg.devices.size();
    if (!reports(cfg)) return 0;  // rank 0 prints the job's line
    std::printf("{\"framework\": \"tandem\", \"model\": \"%s\", \"path\": \"%s\", \"devices\": %zu, "
                "\"batch_size\": %lld, \"median_s\": %.5f, \"images_per_s\": %.1f, \"train_acc\": %.4f, "
                "\"peak_mb\": %.1f}\n",
                model.c_str(), path.c_str(), devices, static_cast<long long>(cfg.batch_size), median,
                ips, acc, static_cast<double>(max_allocated_bytes(cfg.devices.front())) / (1 << 20));
    return 0;
  } catch (const ArgsError& e) {
    std::fprintf(stderr, "bench_train: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train: error: %s\n", e.what());
    return 1;
  }
}
