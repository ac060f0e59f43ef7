// Trains LeNet on Fashion-MNIST on the CPU, one GPU, several devices, or one process per device.
//
//   lenet                                   d2l's LeNet (sigmoid, average pooling), SGD lr 0.9
//   lenet --activation relu --momentum 0.9  ReLU + max pooling, SGD lr 0.1
//   lenet --devices cuda:0,cuda:1 --parallel scratch --comm nccl
//   lenet --devices cpu:0,cpu:1             the same data-parallel code on virtual CPU devices
//   tandem-run --nproc-per-node 2 lenet     one process per GPU (DDP; or torchrun, mpirun, srun)
//   tandem-run --nproc-per-node 2 lenet --device cpu   two CPU processes over Gloo
//   tandem-run --nproc-per-node 2 lenet --zero 2       ZeRO: the state sharded over the processes
//
// --batch-size is the global batch in every mode: split across devices, or across processes,
// so a run's numbers do not depend on how many devices or processes compute them.
#include "common/cli.h"
#include "nn/models/lenet.h"

using namespace tandem;
using namespace tandem::examples;

int main(int argc, char** argv) {
  ProgramSpec spec;
  spec.name = "lenet";
  spec.summary = "Trains LeNet on Fashion-MNIST on the CPU, one GPU, several devices, or one process per\n"
                 "device under a launcher (tandem-run, torchrun, mpirun, srun) or with --distributed.\n"
                 "--batch-size is the global batch in every mode.\n"
                 "Default learning rate: 0.9 with sigmoid, 0.1 with relu, 0.001 with adam.";
  spec.add_flags = [](Args& args) {
    args.option("activation", "sigmoid", "sigmoid (with average pooling) | relu (with max pooling)");
  };
  spec.configure = [](const Args& args, TrainConfig& cfg, std::string& description) {
    std::string act = args.choice("activation", {"sigmoid", "relu"});
    nn::models::LeNetOptions opts;
    opts.activation = act == "relu" ? nn::models::LeNetActivation::ReLU : nn::models::LeNetActivation::Sigmoid;
    uint64_t seed = cfg.seed;
    cfg.make_model = [opts, seed] {
      Generator gen(seed);
      return nn::models::lenet(opts, gen);
    };
    cfg.lr = act == "relu" ? 0.1 : 0.9;
    description = "LeNet (" + act + ")";
  };
  return train_main(argc, argv, spec);
}
