// Trains ResNet-18 (d2l's Fashion-MNIST variant: 3x3 stem, no max-pool, 28x28 input) on
// Fashion-MNIST on one GPU or several: the model that is large enough for data parallelism
// to pay off.
//
//   resnet --devices cuda:0,cuda:1 --batch-size 512 --epochs 10
//   tandem-run --nproc-per-node gpu resnet --batch-size 512   one process per GPU (DDP)
//   tandem-run --nproc-per-node gpu resnet --sync-bn          ... with SyncBatchNorm
//   tandem-run --nproc-per-node gpu resnet --zero 3           ... with FSDP (--zero 1|2: ZeRO stages)
//
// --batch-size is the global batch in every mode, split across devices or processes.
#include "common/cli.h"
#include "nn/models/resnet.h"

using namespace tandem;
using namespace tandem::examples;

int main(int argc, char** argv) {
  ProgramSpec spec;
  spec.name = "resnet";
  spec.summary = "Trains ResNet-18 on Fashion-MNIST on one GPU, several devices, or one process per device\n"
                 "under a launcher or with --distributed (default lr 0.05). --batch-size is the global batch.";
  spec.configure = [](const Args& args, TrainConfig& cfg, std::string& description) {
    uint64_t seed = cfg.seed;
    cfg.make_model = [seed] {
      Generator gen(seed);
      return nn::models::resnet18(10, 1, gen);
    };
    cfg.lr = 0.05;
    description = "ResNet-18";
  };
  return train_main(argc, argv, spec);
}
