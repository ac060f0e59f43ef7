// PyTorch's "Getting Started with Distributed Data Parallel" tutorial, written with tandem: one
// process per device, each training LeNet on its share of Fashion-MNIST, the gradients averaged
// across processes while backward runs. Read it beside the tutorial; each block names the
// PyTorch line it stands for.
//
//   ddp_tutorial --nprocs 2 --device cpu          starts its own 2 workers (mp.spawn)
//   tandem-run --nproc-per-node 2 ddp_tutorial    or a launcher starts them (torchrun)
//
// One difference to keep in mind: tandem's --batch-size is the *global* batch, split across the
// processes, where the tutorial's DataLoader batch is per process.
#include <algorithm>
#include <cstdio>

#include "autograd/ops.h"
#include "common/args.h"
#include "data/dataloader.h"
#include "data/fashion_mnist.h"
#include "kernels/ops.h"
#include "nn/models/lenet.h"
#include "nn/optim/sgd.h"
#include "parallel/distributed/ddp.h"
#include "parallel/distributed/launch.h"

using namespace tandem;
namespace dist = tandem::parallel::distributed;

struct Flags {
  std::string data, device;
  int64_t nprocs, epochs, batch_size, train_limit;
};

// def setup(rank, world_size):
//     os.environ["MASTER_ADDR"] = "localhost"; os.environ["MASTER_PORT"] = "12355"
//     dist.init_process_group("gloo", rank=rank, world_size=world_size)
// RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from spawn() or the launcher.
dist::DistributedContext setup(Device device) {
  return dist::init_process_group(device.is_cpu() ? "gloo" : "nccl", device);
}

// def cleanup(): dist.destroy_process_group()
void cleanup(dist::DistributedContext& ctx) {
  ctx = {};
}

// def demo_basic(rank, world_size):
void demo_basic(int rank, int world_size, const Flags& f) {
  // print(f"Running basic DDP example on rank {rank}.")
  std::printf("running basic DDP example on rank %d of %d\n", rank, world_size);
  // device_id = rank % torch.cuda.device_count() -- here: this node's LOCAL_RANK, or the CPU
  const bool gpu = f.device == "cuda" || (f.device == "auto" && cuda_available());
  const Device device = gpu ? Device::cuda(dist::read_dist_env().local_rank) : kCPU;
  dist::DistributedContext ctx = setup(device);
  {
    // model = ToyModel().to(device_id); ddp_model = DDP(model, device_ids=[device_id])
    // (every rank builds its own; DDP broadcasts rank 0's weights so they all start equal)
    Generator gen(rank);
    dist::DistributedDataParallel ddp_model(nn::models::lenet({}, gen), ctx.group);
    // loss_fn = nn.CrossEntropyLoss(); optimizer = optim.SGD(ddp_model.parameters(), lr=0.9)
    nn::optim::SGD optimizer(ddp_model.parameters(), 0.9);

    // sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    // loader = DataLoader(dataset, batch_size=..., sampler=sampler, drop_last=True)
    // (drop_last: no short last batch, so every step gives every rank its share of rows)
    data::FashionMnist train = data::load_fashion_mnist(f.data, true, f.train_limit);
    auto sampler =
        std::make_shared<data::DistributedSampler>(train.images.size(0), world_size, rank, true);
    data::DataLoader loader(data::TensorDataset(train.images, train.labels),
                            {.batch_size = std::min(f.batch_size, train.images.size(0)),
                             .drop_last = true,
                             .device = device,
                             .sampler = sampler});

    for (int64_t epoch = 0; epoch < f.epochs; ++epoch) {
      sampler->set_epoch(epoch);  // sampler.set_epoch(epoch): a new shuffle, the same on every rank
      Tensor loss_sum = zeros({}, kFloat32, device);  // this rank's summed loss, on the device
      int64_t rows = 0;
      for (const data::Batch& b : loader) {
        optimizer.zero_grad();                             // optimizer.zero_grad()
        Tensor loss = cross_entropy(ddp_model(b.x), b.y);  // loss_fn(ddp_model(inputs), labels)
        loss.backward();   // loss.backward(): each bucket's allreduce starts while backward runs
        optimizer.step();  // optimizer.step(): the same averaged gradient on every rank
        kernels::axpby_(static_cast<double>(b.x.size(0)), loss.detach(), 1.0, loss_sum);
        rows += b.x.size(0);
      }
      // dist.all_reduce(t, op=dist.ReduceOp.SUM): the job's mean loss, printed by rank 0 only
      Tensor totals = full({2}, static_cast<double>(rows), kFloat64, device);  // [loss sum, rows]
      totals.slice(0, 0, 1).copy_(loss_sum.reshape({1}));
      ctx.group->allreduce(totals, dist::ReduceOp::Sum)->wait();
      const std::vector<double> t = totals.to_vector<double>();
      if (rank == 0)
        std::printf("epoch %lld  loss %.4f  (%.0f images on %d process%s)\n",
                    static_cast<long long>(epoch + 1), t[0] / t[1], t[1], world_size,
                    world_size == 1 ? "" : "es");
    }
  }
  cleanup(ctx);
  // print(f"Finished running basic DDP example on rank {rank}.")
  std::printf("finished running basic DDP example on rank %d\n", rank);
}

// if __name__ == "__main__": mp.spawn(demo_basic, args=(world_size,), nprocs=world_size, join=True)
// spawn() re-executes this program once per rank; under a launcher it runs demo_basic directly.
int main(int argc, char** argv) {
  examples::Args args(
      "ddp_tutorial",
      "PyTorch's DDP tutorial with tandem: LeNet on Fashion-MNIST, one process per device.");
  args.option("nprocs", "2", "processes to start (under a launcher of several processes: its world size)");
  args.option("data", data::kFashionMnistDefaultDir, "folder with the Fashion-MNIST IDX files");
  args.option("device", "auto",
              "auto|cuda|cpu: cuda gives each process its LOCAL_RANK's GPU (nccl), cpu uses gloo");
  args.option("epochs", "2", "training epochs");
  args.option("batch-size", "256", "global minibatch size, split across the processes");
  args.option("train-limit", "-1", "use only the first N training images (-1: all)");
  Flags f;
  try {
    if (!args.parse(argc, argv)) {
      std::fputs(args.help().c_str(), stdout);
      return 0;
    }
    f = {args.str("data"),
         args.choice("device", {"auto", "cuda", "cpu"}),
         args.integer("nprocs", 1, 64),
         args.integer("epochs", 1, 1000),
         args.integer("batch-size", 1, 1 << 20),
         args.integer("train-limit", -1)};
  } catch (const examples::ArgsError& e) {
    std::fprintf(stderr, "ddp_tutorial: %s\n", e.what());
    return 2;
  }
  // Under a launcher that started several processes, this process is one rank of that job:
  // its world size is the number of ranks, whatever --nprocs says.
  int nprocs = static_cast<int>(f.nprocs);
  if (dist::launched_by_launcher()) {
    const int world = dist::read_dist_env().world_size;
    if (world > 1) nprocs = world;
  }
  return dist::spawn(nprocs,
                     [&f](int rank, int world_size) { demo_basic(rank, world_size, f); });
}
