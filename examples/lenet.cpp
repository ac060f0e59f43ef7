// Trains LeNet on Fashion-MNIST on the CPU, one GPU, or several devices.
//
//   lenet                                   d2l's LeNet (sigmoid, average pooling), SGD lr 0.9
//   lenet --activation relu --lr 0.1 --momentum 0.9
//   lenet --devices cuda:0,cuda:1 --parallel scratch --comm nccl
//   lenet --devices cpu:0,cpu:1             the same data-parallel code on virtual CPU devices
#include <cstdio>
#include <exception>

#include "common/args.h"
#include "common/train.h"
#include "core/error.h"
#include "data/fashion_mnist.h"
#include "nn/models/lenet.h"

using namespace tandem;
using namespace tandem::examples;

int main(int argc, char** argv) {
  Args args("lenet", "Trains LeNet on Fashion-MNIST on the CPU, one GPU or several devices.");
  args.option("data", data::kFashionMnistDefaultDir, "folder with the Fashion-MNIST IDX files (.gz or raw)");
  args.option("device", "", "one device: cpu, cuda, cuda:N (default: a GPU if present, else cpu)");
  args.option("devices", "", "several devices, e.g. cuda:0,cuda:1 or cpu:0,cpu:1 (data-parallel)");
  args.option("parallel", "scratch", "data-parallel path with several devices: scratch|dp");
  args.option("comm", "nccl", "gradient allreduce of the scratch path: naive|ring|nccl (nccl: GPUs only)");
  args.option("epochs", "10", "training epochs");
  args.option("batch-size", "256", "global minibatch size (split across devices)");
  args.option("lr", "", "learning rate (default: 0.9 with sigmoid, 0.1 with relu)");
  args.option("optimizer", "sgd", "sgd|adam");
  args.option("momentum", "0", "SGD momentum");
  args.option("weight-decay", "0", "L2 weight decay");
  args.option("activation", "sigmoid", "sigmoid (with average pooling) | relu (with max pooling)");
  args.option("seed", "0", "seed for initialization and shuffling");
  args.option("train-limit", "-1", "use only the first N training images (-1: all)");
  args.option("test-limit", "-1", "use only the first N test images (-1: all)");
  args.option("csv", "", "write one row per epoch to this CSV file");
  args.option("trace", "", "write a Chrome-trace timeline of the first epoch's steps (several devices)");
  args.flag("no-progress", "never draw the progress bar");
  try {
    if (!args.parse(argc, argv)) {
      std::fputs(args.help().c_str(), stdout);
      return 0;
    }
    TrainConfig cfg;
    std::string act = args.choice("activation", {"sigmoid", "relu"});
    nn::models::LeNetOptions opts;
    opts.activation = act == "relu" ? nn::models::LeNetActivation::ReLU : nn::models::LeNetActivation::Sigmoid;
    uint64_t seed = static_cast<uint64_t>(args.integer("seed", 0));
    cfg.make_model = [opts, seed] {
      Generator gen(seed);
      return nn::models::lenet(opts, gen);
    };
    if (args.given("devices") && args.given("device"))
      throw ArgsError("give --device or --devices, not both");
    if (args.given("devices")) cfg.devices = parse_device_list(args.str("devices"));
    else if (args.given("device")) cfg.devices = {Device::parse(args.str("device"))};
    else cfg.devices = default_devices();
    cfg.data_dir = args.str("data");
    cfg.parallel = args.choice("parallel", {"scratch", "dp"});
    cfg.comm = args.choice("comm", {"naive", "ring", "nccl"});
    if (!args.given("comm") && cfg.devices.front().is_cpu()) cfg.comm = "ring";
    cfg.epochs = args.integer("epochs", 1, 100000);
    cfg.batch_size = args.integer("batch-size", 1, 1 << 20);
    cfg.optimizer = args.choice("optimizer", {"sgd", "adam"});
    cfg.lr = args.given("lr") ? args.real("lr", 0.0, 1e6) : (act == "relu" ? 0.1 : 0.9);
    if (cfg.optimizer == "adam" && !args.given("lr")) cfg.lr = 1e-3;
    cfg.momentum = args.real("momentum", 0.0, 1.0);
    cfg.weight_decay = args.real("weight-decay", 0.0, 1.0);
    cfg.seed = seed;
    cfg.train_limit = args.integer("train-limit", -1);
    cfg.test_limit = args.integer("test-limit", -1);
    if (cfg.train_limit == 0 || cfg.test_limit == 0) throw ArgsError("--train-limit/--test-limit must be -1 or >= 1");
    cfg.csv = args.str("csv");
    cfg.trace = args.str("trace");
    cfg.progress = !args.on("no-progress");

    std::string devs;
    for (Device d : cfg.devices) devs += (devs.empty() ? "" : ",") + d.str();
    std::printf("LeNet (%s) on %s%s, batch %lld, %s lr %g\n", act.c_str(), devs.c_str(),
                cfg.devices.size() > 1 ? (" [" + cfg.parallel + (cfg.parallel == "scratch" ? "/" + cfg.comm : "") + "]").c_str() : "",
                static_cast<long long>(cfg.batch_size), cfg.optimizer.c_str(), cfg.lr);
    run_training(cfg, [](const EpochStats& s) {
      std::printf("%s\n", format_epoch(s).c_str());
      std::fflush(stdout);
    });
    return 0;
  } catch (const ArgsError& e) {
    std::fprintf(stderr, "lenet: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lenet: error: %s\n", e.what());
    return 1;
  }
}
