// SyncBatchNorm (nn/sync_batchnorm.h): in this process over a Gloo group of one (equal to
// BatchNorm2d, gradient check, ResNet-18 conversion, errors), across 2 and 3 processes started
// by tandem-run (the worker's syncbn mode: uneven and empty shards against one process's batch
// norm on the whole batch; a rank killed in the forward's allgather), and on one GPU over NCCL
// (a forward and backward captured in a CUDA graph: no host synchronization).
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>

#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "catch.h"
#include "distributed/worker_run.h"
#include "core/cuda_graph.h"
#include "core/generator.h"
#include "data/data_test_util.h"
#include "helpers.h"
#include "kernels/backend.h"
#include "nn/models/resnet.h"
#include "nn/residual.h"
#include "nn/nn_test_util.h"
#include "nn/nn.h"
#include "nn/sync_batchnorm.h"
#include "parallel/distributed/launch.h"
#include "parallel/distributed/process_group.h"

using namespace tandem;
using namespace tandem::parallel::distributed;
using tandem::test::contains;

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

bool gloo_built() {
  for (const auto& b : process_group_backends()) if (b == "gloo") return true;
  return false;
}

template <typename M>
int count_modules(nn::Module& root) {
  int n = 0;
  root.apply([&](nn::Module& m) { n += dynamic_cast<M*>(&m) != nullptr ? 1 : 0; });
  return n;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && test::values(a) == test::values(b);
}

}  // namespace

TEST_CASE("SyncBatchNorm over a group of one is BatchNorm2d bit for bit, also in its fused forms", "[nn][syncbn]") {
  if (!gloo_built()) {
    WARN("tandem built without Gloo: skipped");
    return;
  }
  const test::SettingRestore restore_relu(set_fuse_bn_relu, fuse_bn_relu);
  const test::SettingRestore restore_bias(set_fuse_conv_bias, fuse_conv_bias);
  const test::SettingRestore restore_join(set_fuse_bn_add_relu, fuse_bn_add_relu);
  OneRank job("gloo");
  Generator gen(5);
  // One step of a and of b (b: a with SyncBatchNorm): the same output and gradients, bit for bit.
  const auto same_step = [](nn::Module& a, nn::Module& b, const Tensor& x) {
    a.zero_grad(), b.zero_grad();
    Tensor ya = a(x), yb = b(x);
    CHECK(same_bits(ya, yb));
    sum(mul(ya, ya)).backward();
    sum(mul(yb, yb)).backward();
    auto pa = a.parameters(), pb = b.parameters();
    for (size_t k = 0; k < pa.size(); ++k) CHECK(same_bits(pa[k].grad(), pb[k].grad()));
  };
  for (bool fuse : {false, true}) {
    set_fuse_bn_relu(fuse);
    set_fuse_conv_bias(fuse);
    auto a = std::make_shared<nn::SequentialImpl>(std::initializer_list<std::shared_ptr<nn::Module>>{
        std::make_shared<nn::Conv2d>(2, 3, 3, 1, 1, true, gen), std::make_shared<nn::BatchNorm2d>(3),
        std::make_shared<nn::ReLU>()});
    auto b = std::dynamic_pointer_cast<nn::SequentialImpl>(a->clone());
    nn::convert_sync_batchnorm(b, job.group);
    REQUIRE(count_modules<nn::SyncBatchNorm>(*b) == 1);
    const Tensor x = randn({4, 2, 5, 5}, kFloat32, kCPU, &gen);
    for (int step = 0; step < 2; ++step) {
      same_step(*a, *b, x);
      auto sa = a->buffers(), sb = b->buffers();
      for (size_t k = 0; k < sa.size(); ++k) CHECK(same_bits(sa[k], sb[k]));
    }
  }
  // A Residual block, whose second batch norm joins the shortcut (forward_add_relu) when
  // fuse_bn_add_relu() is on: over a group of one, the same bits as BatchNorm2d.
  for (bool fuse : {false, true}) {
    set_fuse_bn_add_relu(fuse);
    set_fuse_conv_bias(fuse);
    auto a = std::make_shared<nn::Residual>(2, 2, false, 1, gen);
    auto b = std::dynamic_pointer_cast<nn::Residual>(a->clone());
    nn::convert_sync_batchnorm(b, job.group);
    REQUIRE(count_modules<nn::SyncBatchNorm>(*b) == 2);
    same_step(*a, *b, randn({4, 2, 5, 5}, kFloat32, kCPU, &gen));
  }
}

TEST_CASE("sync_batch_norm through a group of one equals batch_norm: float64, channels-last, bfloat16", "[nn][syncbn]") {
  if (!gloo_built()) {
    WARN("tandem built without Gloo: skipped");
    return;
  }
  OneRank job("gloo");
  Generator gen(9);
  for (const Shape& shape : {Shape{5, 3, 4, 3}, Shape{7, 4}}) {
    const int64_t c = shape[1];
    const Tensor x0 = randn(shape, kFloat64, kCPU, &gen), r = randn(shape, kFloat64, kCPU, &gen);
    const Tensor g0 = randn({c}, kFloat64, kCPU, &gen), b0 = randn({c}, kFloat64, kCPU, &gen);
    Tensor x = x0.clone(), g = g0.clone(), b = b0.clone(), xr = x0.clone(), gr = g0.clone(), br = b0.clone();
    for (Tensor* t : {&x, &g, &b, &xr, &gr, &br}) t->set_requires_grad(true);
    Tensor rm = zeros({c}, kFloat64), rv = ones({c}, kFloat64), rmr = rm.clone(), rvr = rv.clone();
    Tensor y = nn::sync_batch_norm(x, g, b, rm, rv, 0.1, 1e-5, job.group);
    Tensor yr = batch_norm(xr, gr, br, rmr, rvr, true, 0.1, 1e-5);
    sum(mul(y, r)).backward();
    sum(mul(yr, r)).backward();
    CHECK(test::rel_error(y, yr) < 1e-12);
    CHECK(test::rel_error(x.grad(), xr.grad()) < 1e-12);
    CHECK(test::rel_error(g.grad(), gr.grad()) < 1e-12);
    CHECK(test::rel_error(b.grad(), br.grad()) < 1e-12);
    CHECK(test::rel_error(rm, rmr) < 1e-12);
    CHECK(test::rel_error(rv, rvr) < 1e-12);
  }
  SECTION("channels-last input gives a channels-last output of the same values") {
    const Tensor x = randn({4, 3, 5, 5}, kFloat32, kCPU, &gen);
    const Tensor xcl = x.contiguous(MemoryFormat::ChannelsLast);
    Tensor rm = zeros({3}), rv = ones({3}), rm2 = zeros({3}), rv2 = ones({3});
    Tensor y = nn::sync_batch_norm(x, Tensor(), Tensor(), rm, rv, 0.1, 1e-5, job.group);
    Tensor ycl = nn::sync_batch_norm(xcl, Tensor(), Tensor(), rm2, rv2, 0.1, 1e-5, job.group);
    CHECK(ycl.is_contiguous(MemoryFormat::ChannelsLast));
    CHECK(test::rel_error(ycl, y) < 1e-6);
  }
  SECTION("bfloat16 input: float32 statistics, a bfloat16 output as BatchNorm2d's") {
    const Tensor x = randn({6, 3, 4, 4}, kFloat32, kCPU, &gen).to(kBFloat16);
    nn::SyncBatchNorm sbn(3, 1e-5, 0.1, job.group);
    Tensor rm = zeros({3}), rv = ones({3});
    Tensor y = nn::sync_batch_norm(x, sbn.weight(), sbn.bias(), rm, rv, 0.1, 1e-5, job.group);
    nn::BatchNorm2d ref(3);
    Tensor yr = ref(x);
    CHECK(y.dtype() == kBFloat16);
    CHECK(test::rel_error(y, yr) < 2e-2);  // bfloat16 keeps 8 bits of mantissa
    CHECK(test::rel_error(rm, ref.running_mean()) < 1e-5);
    CHECK(test::rel_error(rv, ref.running_var()) < 1e-5);
  }
}

TEST_CASE("sync_batch_norm passes a float64 finite-difference gradient check", "[nn][syncbn][gradcheck]") {
  if (!gloo_built()) {
    WARN("tandem built without Gloo: skipped");
    return;
  }
  OneRank job("gloo");
  Generator gen(13);
  for (const Shape& shape : {Shape{3, 2, 3, 2}, Shape{5, 3}}) {
    const int64_t c = shape[1];
    Tensor rm = zeros({c}, kFloat64), rv = ones({c}, kFloat64);
    const Tensor r = randn(shape, kFloat64, kCPU, &gen);
    auto fn = [&](const std::vector<Tensor>& in) {
      return mul(nn::sync_batch_norm(in[0], in[1], in[2], rm, rv, 0.1, 1e-5, job.group), r);
    };
    auto res = autograd::gradcheck(fn, {randn(shape, kFloat64, kCPU, &gen), randn({c}, kFloat64, kCPU, &gen),
                                        randn({c}, kFloat64, kCPU, &gen)});
    INFO(res.message);
    CHECK(res.ok);
  }
}

TEST_CASE("convert_sync_batchnorm replaces every BatchNorm2d of ResNet-18, keeping parameters and buffers",
          "[nn][syncbn]") {
  if (!gloo_built()) {
    WARN("tandem built without Gloo: skipped");
    return;
  }
  OneRank job("gloo");
  Generator gen(21);
  std::shared_ptr<nn::Module> net = nn::models::resnet18(10, 1, gen);
  const int bns = count_modules<nn::BatchNorm2d>(*net);
  CHECK(bns == 17);  // the stem's, and two in each of the 8 residual blocks
  // Give the buffers non-default values, so that keeping them is visible.
  Tensor x = randn({4, 1, 32, 32}, kFloat32, kCPU, &gen);
  (*net)(x);
  net->eval();
  const Tensor y_before = (*net)(x);
  const nn::StateDict before = net->state_dict();
  std::vector<Tensor> copies;
  for (const auto& k : before.keys()) copies.push_back(before.at(k).clone());

  std::shared_ptr<nn::Module> converted = nn::convert_sync_batchnorm(net, job.group);
  CHECK(converted == net);
  CHECK(count_modules<nn::SyncBatchNorm>(*net) == bns);
  int plain = 0;
  net->apply([&](nn::Module& m) {
    plain += dynamic_cast<nn::BatchNorm2d*>(&m) != nullptr && dynamic_cast<nn::SyncBatchNorm*>(&m) == nullptr;
  });
  CHECK(plain == 0);
  const nn::StateDict after = net->state_dict();
  REQUIRE(after.keys() == before.keys());
  for (size_t k = 0; k < copies.size(); ++k) CHECK(same_bits(after.at(before.keys()[k]), copies[k]));
  CHECK_FALSE(net->is_training());
  CHECK(same_bits((*net)(x), y_before));  // eval: the running statistics, no collective
  net->apply([&](nn::Module& m) {
    if (auto* s = dynamic_cast<nn::SyncBatchNorm*>(&m)) CHECK(s->process_group() == job.group);
  });
  // A BatchNorm2d itself comes back as a new SyncBatchNorm; converting twice changes nothing.
  auto bn = std::make_shared<nn::BatchNorm2d>(4);
  auto sbn = nn::convert_sync_batchnorm(bn, job.group);
  CHECK(dynamic_cast<nn::SyncBatchNorm*>(sbn.get()) != nullptr);
  CHECK(nn::convert_sync_batchnorm(sbn, job.group) == sbn);
}

TEST_CASE("SyncBatchNorm without a process group: a clear error in training, BatchNorm2d in eval", "[nn][syncbn]") {
  Generator gen(1);
  const Tensor x = randn({4, 4, 3, 3}, kFloat32, kCPU, &gen);
  nn::SyncBatchNorm sbn(4);
  const std::string msg = test::error_message<ValueError>([&] { sbn(x); });
  CHECK(contains(msg, "SyncBatchNorm(4)"));
  CHECK(contains(msg, "process group"));
  sbn.eval();
  nn::BatchNorm2d ref(4);
  ref.eval();
  CHECK(same_bits(sbn(x), ref(x)));
  auto net = std::make_shared<nn::BatchNorm2d>(4);
  CHECK(contains(test::error_message<ValueError>([&] { nn::convert_sync_batchnorm(net, nullptr); }),
                 "no process group"));
}

#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)

namespace {

using Result = tandem::test::WorkerResult;
using tandem::test::sh;
std::string env(int timeout_s = 20) { return tandem::test::dist_timeout_env(timeout_s); }
Result run(const tandem::test::TempDir& dir, int n, const std::string& args, int timeout_s = 20) {
  return tandem::test::run_workers(dir, n, args, timeout_s);
}

size_t count_of(const std::string& text, const std::string& part) {
  size_t k = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++k;
  return k;
}

}  // namespace

TEST_CASE("SyncBatchNorm on 2 and 3 processes, uneven and empty shards, equals batch norm on the whole batch",
          "[dist][gloo][syncbn]") {
  test::TempDir dir;
  // The worker checks outputs, input/weight/bias gradients and running statistics of 3 steps
  // and eval: float64 within 1e-9, float32 within 1e-4 (Note [sync batch norm]).
  for (const auto& [n, sizes] : std::vector<std::pair<int, std::string>>{{2, "3,6"}, {2, "0,7"}, {3, "4,0,3"}}) {
    Result r = run(dir, n, "syncbn --sizes " + sizes);
    INFO(sizes << "\n" << r.output);
    CHECK(r.code == 0);
    CHECK(count_of(r.output, "syncbn ok") == size_t(n));
  }
}

TEST_CASE("A rank killed before SyncBatchNorm's allgather ends the job, naming the rank", "[dist][gloo][syncbn][failure]") {
  test::TempDir dir;
  Result r = run(dir, 3, "syncbn-kill --kill-rank 1 --kill-step 2", /*timeout_s=*/5);
  INFO(r.output);
  CHECK(r.code != 0);
  CHECK(r.seconds < 5 + 3);
  CHECK(contains(r.output, "rank 1 (pid"));
  CHECK(contains(r.output, "SIGKILL"));
  // Started by hand (no launcher to stop rank 0): rank 0, waiting in the allgather, names it.
  const int port = free_port();
  const std::string common = "TANDEM_DIST_TIMEOUT=5 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                             std::to_string(port) + " TANDEM_JOB_ID=s" + std::to_string(port) + " ";
  const std::string w = TANDEM_DIST_WORKER_PATH;
  r = sh(dir, "(" + common + "RANK=1 LOCAL_RANK=1 " + w + " syncbn-kill & " + common + "RANK=0 LOCAL_RANK=0 " + w +
                  " syncbn-kill; echo rank0 exit $?; wait)");
  INFO(r.output);
  CHECK(contains(r.output, "rank0 exit 1"));
  CHECK(r.seconds < 5 + 10);
  CHECK(std::regex_search(r.output, std::regex("allgather #[0-9]+ .* on rank 0 of 2")));
  CHECK(contains(r.output, "rank 1"));
}

#endif

TEST_CASE("sync_batch_norm over NCCL is captured in a CUDA graph and replays the eager values", "[cuda][dist][syncbn]") {
  TANDEM_REQUIRE_CUDA();
#ifndef TANDEM_WITH_NCCL
  WARN("tandem built without NCCL: skipped");
  return;
#endif
  const Device gpu = Device::cuda(0);
  DeviceGuard guard(gpu);
  OneRank job("nccl");
  Generator gen(17);
  const Shape shape{6, 4, 5, 5};
  Tensor x = randn(shape, kFloat32, gpu, &gen), r = randn(shape, kFloat32, gpu, &gen);
  Tensor g = randn({4}, kFloat32, gpu, &gen), b = randn({4}, kFloat32, gpu, &gen);
  for (Tensor* t : {&x, &g, &b}) t->set_requires_grad(true);
  Tensor rm = zeros({4}, kFloat32, gpu), rv = ones({4}, kFloat32, gpu), y = zeros(shape, kFloat32, gpu);
  // Gradients exist before the capture, so backward adds into them in place.
  x.set_grad(zeros(shape, kFloat32, gpu)), g.set_grad(zeros({4}, kFloat32, gpu)), b.set_grad(zeros({4}, kFloat32, gpu));
  auto step = [&] {
    for (Tensor* t : {&x, &g, &b}) t->grad().zero_();
    Tensor out = nn::sync_batch_norm(x, g, b, rm, rv, 0.1, 1e-5, job.group);
    sum(mul(out, r)).backward();
    y.copy_(out.detach());
  };
  step();  // eager, the reference
  const Tensor y0 = y.clone(), dx0 = x.grad().clone(), dg0 = g.grad().clone(), db0 = b.grad().clone();
  const Tensor rm1 = rm.clone(), rv1 = rv.clone();
  CUDAGraph graph;
  graph.capture_begin(gpu);
  try {
    step();
  } catch (...) {
    graph.capture_abort();
    throw;
  }
  graph.capture_end();
  REQUIRE(graph.captured());
  rm.copy_(zeros({4}, kFloat32, gpu)), rv.copy_(ones({4}, kFloat32, gpu));
  graph.replay();
  CHECK(test::rel_error(y, y0) < 1e-6);
  CHECK(test::rel_error(x.grad(), dx0) < 1e-6);
  CHECK(test::rel_error(g.grad(), dg0) < 1e-6);
  CHECK(test::rel_error(b.grad(), db0) < 1e-6);
  CHECK(test::rel_error(rm, rm1) < 1e-6);
  CHECK(test::rel_error(rv, rv1) < 1e-6);
  // And the GPU's values are the CPU's.
  Tensor rmc = zeros({4}, kFloat32), rvc = ones({4}, kFloat32);
  Tensor xc = x.detach().to(kCPU);
  CHECK(test::rel_error(batch_norm(xc, g.detach().to(kCPU), b.detach().to(kCPU), rmc, rvc, true, 0.1, 1e-5), y0.to(kCPU)) <
        1e-5);
}
