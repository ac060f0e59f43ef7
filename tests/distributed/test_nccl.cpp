// The NCCL process group and DDP over it. One GPU: a world-size-1 group in this process
// (collectives, DDP training equal to plain training). Two GPUs: two processes started by
// tandem-run, the same checks as over Gloo; skipped with a message on fewer GPUs.
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <fstream>
#include <sstream>
#include <thread>

#include "autograd/ops.h"
#include "catch.h"
#include "core/generator.h"
#include "helpers.h"
#include "nn/models/lenet.h"
#include "nn/nn.h"
#include "core/cuda_graph.h"
#include "parallel/distributed/collective_graph.h"
#include "parallel/distributed/ddp.h"
#include "parallel/distributed/process_group.h"
#include "parallel/sharded/zero_optimizer.h"

using namespace tandem;
using namespace tandem::parallel::distributed;

// Skips a test on a machine without a GPU, or where tandem was built without NCCL.
#ifdef TANDEM_WITH_NCCL
#define REQUIRE_NCCL() TANDEM_REQUIRE_CUDA()
#else
#define REQUIRE_NCCL()                          \
  do {                                          \
    TANDEM_REQUIRE_CUDA();                      \
    WARN("tandem built without NCCL: skipped"); \
    return;                                     \
  } while (0)
#endif

namespace {

// A one-rank job in this process: a store on a free port and a group of one.
struct OneRank {
  std::shared_ptr<TCPStore> store;
  std::shared_ptr<ProcessGroup> group;
  explicit OneRank(const std::string& backend) {
    TCPStoreOptions o;
    o.is_master = true;
    o.rank = 0;
    o.timeout = std::chrono::seconds(20);
    o.job_id = "test";
    store = std::make_shared<TCPStore>("127.0.0.1", 0, o);
    group = new_process_group(backend, std::make_shared<PrefixStore>("pg", store), 0, 1);
  }
};

// LeNet with the same initial weights every call.
std::shared_ptr<nn::SequentialImpl> seeded_lenet() {
  Generator gen(3);
  return nn::models::lenet({}, gen);
}

// Several buckets for LeNet's 62k parameters.
DistributedDataParallelOptions several_buckets() {
  DistributedDataParallelOptions o;
  o.bucket_cap_mb = 0.05;
  o.first_bucket_cap_mb = 0.01;
  return o;
}

// A batch of 32 random images and labels, on `device`.
std::pair<Tensor, Tensor> random_batch(Generator& data, Device device) {
  Tensor x = randn({32, 1, 28, 28}, kFloat32, kCPU, &data).to(device);
  std::vector<int64_t> labels(32);
  for (auto& l : labels) l = static_cast<int64_t>(data.next_u64() % 10);
  return {x, from_vector<int64_t>(labels, {32}, device)};
}

}  // namespace

TEST_CASE("NCCL process group of one rank: every collective, on the GPU", "[cuda][dist]") {
  REQUIRE_NCCL();
  DeviceGuard guard(Device::cuda(0));
  OneRank job("nccl");
  ProcessGroup& pg = *job.group;
  CHECK(pg.backend() == "nccl");
  CHECK(pg.device() == Device::cuda(0));
  for (int64_t n : {int64_t(1), int64_t(1001), int64_t(1) << 20}) {
    Tensor t = rand({n}, kFloat32, Device::cuda(0));
    Tensor before = t.clone();
    pg.allreduce(t)->wait();
    CHECK(test::rel_error(t, before) == 0.0);
    pg.allreduce(t, ReduceOp::Avg)->wait();
    CHECK(test::rel_error(t, before) == 0.0);
    Tensor out = zeros({n}, kFloat32, Device::cuda(0));
    pg.allgather(out, t)->wait();
    CHECK(test::rel_error(out, before) == 0.0);
    Tensor part = zeros({n}, kFloat32, Device::cuda(0));
    pg.reduce_scatter(part, t)->synchronize();
    CHECK(test::rel_error(part, before) == 0.0);
    pg.broadcast(t, 0)->wait();
    CHECK(test::rel_error(t, before) == 0.0);
  }
  pg.barrier();
  // CPU tensors belong to gloo.
  CHECK(test::contains(test::error_message<DeviceError>([&] { pg.allreduce(zeros({4}))->wait(); }), "cuda:0"));
}

// Note [one-rank averages] in process_group_nccl.cpp: NCCL before 2.29.7 left the tail of a
// one-rank out-of-place average unwritten. Outputs start as NaN here, and the sizes are not
// multiples of the kernel's block count, so an element left unwritten shows.
TEST_CASE("NCCL process group of one rank: averages write every element, out of place too", "[cuda][dist]") {
  REQUIRE_NCCL();
  DeviceGuard guard(Device::cuda(0));
  OneRank job("nccl");
  ProcessGroup& pg = *job.group;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n : {int64_t(7), int64_t(1001), int64_t(61706), (int64_t(1) << 20) + 3}) {
    INFO("numel " << n);
    Tensor in = rand({n}, kFloat32, Device::cuda(0));
    Tensor part = full({n}, nan, kFloat32, Device::cuda(0));
    pg.reduce_scatter(part, in, ReduceOp::Avg)->synchronize();
    CHECK(part.to_vector<float>() == in.to_vector<float>());
    Tensor t = in.clone();
    pg.allreduce(t, ReduceOp::Avg)->synchronize();
    CHECK(t.to_vector<float>() == in.to_vector<float>());
  }
}

// ZeRO-2's buckets are out-of-place averaging reduce-scatters; with LeNet's 61,706 parameters in
// one bucket, the NCCL defect above trained on the previous step's gradient tail.
TEST_CASE("ZeRO-2 over a one-rank NCCL group steps LeNet like the plain optimizer, one bucket or several",
          "[cuda][dist][zero]") {
  REQUIRE_NCCL();
  using tandem::parallel::sharded::optimizer_class;
  using tandem::parallel::sharded::ZeroRedundancyOptimizer;
  using tandem::parallel::sharded::ZeroRedundancyOptimizerOptions;
  const Device gpu = Device::cuda(0);
  DeviceGuard guard(gpu);
  OneRank job("nccl");
  for (bool one_bucket : {true, false}) {
    INFO((one_bucket ? "one bucket" : "several buckets"));
    auto plain = seeded_lenet(), sharded = seeded_lenet();
    plain->to(gpu);
    sharded->to(gpu);
    ZeroRedundancyOptimizerOptions o;
    o.stage = 2;
    if (!one_bucket) o.bucket_cap_mb = 0.05;
    ZeroRedundancyOptimizer zero(sharded->parameters(),
                                 optimizer_class<nn::optim::SGD>(nn::optim::SGDOptions(0.1).momentum(0.9)),
                                 job.group, o);
    CHECK((zero.num_buckets() == 1) == one_bucket);
    nn::optim::SGD opt(plain->parameters(), nn::optim::SGDOptions(0.1).momentum(0.9));
    Generator data(5);
    for (int step = 0; step < 4; ++step) {
      const auto [x, y] = random_batch(data, gpu);
      opt.zero_grad();
      cross_entropy((*plain)(x), y).backward();
      opt.step();
      zero.zero_grad();
      cross_entropy((*sharded)(x), y).backward();
      zero.step();
    }
    const auto a = plain->parameters(), b = sharded->parameters();
    for (size_t k = 0; k < a.size(); ++k) {
      INFO("parameter " << k);
      const std::vector<float> va = a[k].to_vector<float>(), vb = b[k].to_vector<float>();
      double worst = 0;
      for (size_t i = 0; i < va.size(); ++i)
        worst = std::max(worst, std::abs(double(vb[i]) - va[i]) / (1.0 + std::abs(double(va[i]))));
      CHECK(worst < 1e-6);
    }
  }
}

TEST_CASE("NCCL process group: the monitor thread runs under the group's GPU, and subgroups work", "[cuda][dist]") {
  REQUIRE_NCCL();
  // The last GPU, so that on a machine with several a monitor left on GPU 0 would show.
  const Device gpu = Device::cuda(cuda_device_count() - 1);
  DeviceGuard guard(gpu);
  OneRank job("nccl");
  CHECK(job.group->monitor_device() == gpu);
  auto sub = job.group->new_group({0});
  REQUIRE(sub != nullptr);
  CHECK(sub->device() == gpu);
  CHECK(sub->monitor_device() == gpu);
  CHECK(sub->group_name() == job.group->group_name() + "/sub0");
  Tensor t = full({1000}, 3.0f, kFloat32, gpu);
  sub->allreduce(t, ReduceOp::Max)->wait();
  job.group->allreduce(t)->synchronize();
  for (float v : t.to_vector<float>()) CHECK(v == 3.0f);
}

TEST_CASE("DDP over NCCL with one rank trains LeNet to the plain single-GPU parameters", "[cuda][dist][ddp]") {
  REQUIRE_NCCL();
  const Device gpu = Device::cuda(0);
  DeviceGuard guard(gpu);
  OneRank job("nccl");
  auto plain = seeded_lenet();
  plain->to(gpu);
  DistributedDataParallel ddp(seeded_lenet(), job.group, several_buckets());
  REQUIRE(ddp.reducer().num_buckets() >= 3);
  nn::optim::SGD opt_plain(plain->parameters(), 0.5, 0.9), opt_ddp(ddp.parameters(), 0.5, 0.9);
  Generator data(9);
  for (int step = 0; step < 5; ++step) {
    const auto [x, y] = random_batch(data, gpu);
    opt_plain.zero_grad();
    cross_entropy((*plain)(x), y).backward();
    opt_plain.step();
    opt_ddp.zero_grad();
    cross_entropy(ddp(x), y).backward();
    opt_ddp.step();
  }
  CHECK(ddp.reducer().reductions() == 5);
  const auto a = plain->parameters(), b = ddp.parameters();
  for (size_t k = 0; k < a.size(); ++k) CHECK(test::rel_error(b[k], a[k]) < 1e-5);
}

TEST_CASE("DDP over NCCL in a CUDA graph: replays equal eager steps, keep the numbers, and stop on a failed group",
          "[cuda][dist][ddp][cuda_graph]") {
  REQUIRE_NCCL();
  const Device gpu = Device::cuda(0);
  DeviceGuard guard(gpu);
  OneRank job("nccl");
  DistributedDataParallel eager(seeded_lenet(), job.group, several_buckets()),
      graphed(seeded_lenet(), job.group, several_buckets());
  const int64_t buckets = static_cast<int64_t>(graphed.reducer().num_buckets());
  REQUIRE(buckets >= 3);
  nn::optim::SGD opt_eager(eager.parameters(), nn::optim::SGDOptions(0.5).momentum(0.9));
  nn::optim::SGD opt_graphed(graphed.parameters(), nn::optim::SGDOptions(0.5).momentum(0.9).capturable(true));
  Generator data(9);
  const Tensor images = randn({96, 1, 28, 28}, kFloat32, kCPU, &data).to(gpu);
  std::vector<int64_t> labels(96);
  for (auto& l : labels) l = static_cast<int64_t>(data.next_u64() % 10);
  const Tensor targets = from_vector<int64_t>(labels, {96}, gpu);
  auto step = [](DistributedDataParallel& ddp, nn::optim::Optimizer& opt, const Tensor& x, const Tensor& y) {
    opt.zero_grad();
    cross_entropy(ddp(x), y).backward();
    opt.step();
  };
  auto* collective = new CollectiveGraph({job.group});
  StepGraph graph([&](const std::vector<Tensor>& in) {
    step(graphed, opt_graphed, index_select(in[1], in[0]), index_select(in[2], in[0]));
  }, {/*warmup_steps=*/2, /*enabled=*/true}, std::unique_ptr<CUDAGraph>(collective));
  const uint64_t seq0 = job.group->sequence_number();
  const int steps = 6;
  for (int k = 0; k < steps; ++k) {
    const Tensor index = arange(k % 3 * 32, k % 3 * 32 + 32, 1, kInt64, gpu);
    graph({index}, {images, targets});
  }
  CHECK(graph.captures() == 1);
  CHECK(graph.replays() == steps - 2);
  CHECK(collective->collectives() == std::vector<uint64_t>{static_cast<uint64_t>(buckets)});
  CHECK(job.group->sequence_number() - seq0 == static_cast<uint64_t>(steps * buckets));
  for (int k = 0; k < steps; ++k) {
    const Tensor index = arange(k % 3 * 32, k % 3 * 32 + 32, 1, kInt64, gpu);
    step(eager, opt_eager, index_select(images, index), index_select(targets, index));
  }
  const auto a = eager.parameters(), b = graphed.parameters();
  for (size_t k = 0; k < a.size(); ++k) CHECK(test::rel_error(b[k], a[k]) < 1e-6);

  // Another rank's failure (its abort key) reaches this rank's monitor; the next launch throws
  // the group's error instead of replaying.
  job.group->store().set("pg/abort", "rank 1 failed in a test");
  std::string failure;
  for (int i = 0; i < 200 && failure.empty(); ++i) {
    try {
      job.group->check_healthy();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  CHECK(test::contains(failure, "rank 1 failed in a test"));
  const int64_t replays = graph.replays();
  const Tensor index = arange(0, 32, 1, kInt64, gpu);
  CHECK(test::contains(test::error_message<Error>([&] { graph({index}, {images, targets}); }), "rank 1 failed in a test"));
  CHECK(graph.replays() == replays);
}

#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH)
TEST_CASE("DDP over NCCL on two GPUs, one process each, equals one process", "[cuda][dist][ddp]") {
  TANDEM_REQUIRE_CUDA();
  if (cuda_device_count() < 2) {
    WARN("fewer than 2 GPUs: the two-process NCCL tests need two GPUs (NCCL refuses two ranks on one GPU); skipped");
    return;
  }
  for (const std::string args : {"ddp --nccl --steps 4 --batch 10", "ddp --nccl --bn --steps 5 --batch 11",
                                  "no-sync --nccl --accum 3", "collectives --nccl"}) {
    const std::string cmd = std::string("TANDEM_DIST_TIMEOUT=60 ") + TANDEM_RUN_PATH +
                            " --standalone --nproc-per-node 2 --grace-seconds 1 " + TANDEM_DIST_WORKER_PATH + " " + args +
                            " > nccl_out.txt 2>&1";
    const int status = std::system(cmd.c_str());
    std::ifstream f("nccl_out.txt");
    std::stringstream ss;
    ss << f.rdbuf();
    INFO(args << "\n" << ss.str());
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}
#endif
