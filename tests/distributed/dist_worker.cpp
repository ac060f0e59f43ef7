// One rank of a multi-process test, started by tandem-run (tests/distributed/test_ddp.cpp). Each mode
// checks something across real processes over Gloo and prints what the test reads:
//
//   ring                   the teaching ring allreduce over send/recv (ring_p2p.h) vs allreduce
//   collectives            allreduce/broadcast/allgather/reduce_scatter/send-recv/barrier with
//                          closed-form results (rank r contributes r + 1), sizes tiny, odd, large
// Every mode takes --nccl: the GPU LOCAL_RANK over NCCL instead of the CPU over Gloo
// (collectives then needs CPU tensors: not with --nccl).
//   ddp [--bn] [--steps S] [--batch B] [--bucket-kb K] [--no-overlap] [--pause-ms P]
//                          DDP training; rank 0 also trains the one-process reference on the
//                          same global batches and prints "max_rel_err X"; every rank prints a
//                          hash of its parameters ("params HASH")
//   no-sync [--accum K]    K-1 micro-batches under no_sync, then one synced: equals one batch K
//                          times larger
//   unused [--find-unused] a model with a parameter the loss does not use
//   armed                  which backward DDP reduces is decided by its forward: a backward
//                          through ddp.module() on rank 1 alone, no_sync around a backward only
//                          or around a forward only
//   mismatch               rank 1 builds a different model
//   kill [--kill-rank R] [--kill-step S]   rank R SIGKILLs itself at step S of a long run
//   fingerprint            rank 1 allreduces another size than rank 0
//   silent [--after K]     rank 1 stops calling collectives after K of them (and sleeps)
//   zero [--stage 1|2] [--optim sgd|adam|adamw] [--steps S] [--batch B] [--bucket-kb K] [--ddp]
//                          ZeroRedundancyOptimizer training (--ddp: beside DDP, gradients already
//                          reduced) vs DDP with the plain optimizer in the same ranks
//                          ("zero_vs_ddp X") and, on rank 0, one process on the global batch
//                          ("zero_vs_ref X") and the consolidated state vs the plain optimizer's
//                          ("state_vs_ref X"); "params HASH" per rank; then the state consolidated
//                          to every rank, loaded into a fresh optimizer, one more step ("resume_vs_zero 0")
//   zero-memory [--stage 1|2] [--optim ...] [--bucket-kb K]   one step; "zero-memory ..." lines
//                          with the bytes this rank holds after backward and after the step
//   zero-kill [--stage 1|2] [--kill-at reduce|gather]   rank 1 SIGKILLs itself at step 2 before
//                          its reduce-scatter, or after it and before the all-gather
//   fsdp [--no-shard] [--optim ...] [--steps S] [--batch B]   FullyShardedDataParallel
//                          (SHARD_GRAD_OP, or NO_SHARD) vs DDP ("fsdp_vs_ddp X"), one process
//                          ("fsdp_vs_ref X"), a no-grad forward vs DDP's; "fsdp-memory ..." lines
// Subgroups (4 ranks, test_subgroups.cpp): rows {0,1} {2,3} and columns {0,2} {1,3} of a 2x2 grid.
//   subgroups              different collectives on rows, columns and the world at the same time
//   subgroup-fingerprint   in row {2,3}, global rank 3 allreduces another size
//   subgroup-kill          global rank 3 SIGKILLs itself in the middle of row collectives
//   syncbn --sizes a,b,..  SyncBatchNorm on shards of these sizes (0 allowed) equals one
//                          process's batch norm on the whole batch ("syncbn ok ...")
//   syncbn-kill [--kill-rank R] [--kill-step S]   rank R SIGKILLs itself before a forward
//   pipeline [--schedule gpipe|1f1b] [--micro-batches M] [--adam] [--steps S] [--batch B]
//            [--kill-rank R --kill-step S]
//                          LeNet split into one stage per rank (ProcessPipeline); every rank also
//                          trains the whole model in-process on the same batches and prints
//                          "stage S max_rel_err X loss_err Y" for its stage's parameters
//   pipeline-bench [--schedule gpipe|1f1b] [--micro-batches M] [--steps S] [--width W]
//                  [--layers L] [--rows R] [--trace FILE]
//                          a stage per rank of equal cost (Linear(W, W) + ReLU, L of them), a
//                          batch of 256 (or M micro-batches of R rows), 1F1B by default; prints
//                          each stage's step time and allocator peak; rank 0 writes the merged
//                          timeline of the steps after the first
//   pipeline-messages      2 ranks: a gradient of the wrong shape and an unexpected micro-batch
//                          over ProcessBoundary; prints the errors ("caught: ...")
//   grid [--stages P] [--replicas D] [--schedule ..] [--micro-batches M] [--adam] [--steps S]
//        [--batch B] [--kill-rank R --kill-step S]
//                          LeNet on a P x D grid (GridPipeline, rank = stage * D + replica) vs
//                          one process; "grid stage S replica D max_rel_err X loss_err Y checksum C"
//
// Exit 0 when the check passed, 1 with "rank R: error: ..." on stderr otherwise.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "autograd/ops.h"
#include "distributed/dist_test_model.h"
#include "distributed/worker_fsdp_full.h"
#include "distributed/worker_tensor_parallel.h"
#include "core/allocator.h"
#include "core/generator.h"
#include "nn/nn.h"
#include "parallel/distributed/ddp.h"
#include "parallel/distributed/process_group.h"
#include "parallel/distributed/ring_p2p.h"
#include "parallel/sharded/fsdp.h"
#include "parallel/sharded/zero_optimizer.h"
#include "nn/sync_batchnorm.h"
#include "nn/models/lenet.h"
#include "parallel/pipeline/grid.h"
#include "parallel/pipeline/process_boundary.h"
#include "parallel/trace.h"

using namespace tandem;
using namespace tandem::parallel::distributed;

namespace {

struct Flags {
  std::vector<std::string> args;
  bool on(const char* name) const {
    for (const auto& a : args) if (a == name) return true;
    return false;
  }
  long num(const char* name, long def) const {
    for (size_t i = 0; i + 1 < args.size(); ++i) if (args[i] == name) return std::stol(args[i + 1]);
    return def;
  }
};

// The rank's device: the CPU (gloo), or with --nccl the GPU LOCAL_RANK.
Device g_device = kCPU;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

// ---- collectives -------------------------------------------------------------------------

void run_collectives(ProcessGroup& pg) {
  const int r = pg.rank(), w = pg.size();
  const double sum = w * (w + 1) / 2.0;  // sum of r + 1
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(65539)}) {
    for (DType dt : {kFloat32, kFloat64, kInt64}) {
      Tensor t = full({n}, r + 1, dt, g_device);
      pg.allreduce(t)->wait();
      for (double v : t.to(kFloat64).to_vector<double>()) require(v == sum, "allreduce sum");
    }
    Tensor a = full({n}, r + 1, kFloat32, g_device);
    pg.allreduce(a, ReduceOp::Avg)->wait();
    for (float v : a.to_vector<float>()) require(std::abs(v - sum / w) < 1e-6, "allreduce avg");

    Tensor b = full({n}, r == w - 1 ? 42.0 : -1.0, kFloat64, g_device);
    pg.broadcast(b, w - 1)->wait();
    for (double v : b.to_vector<double>()) require(v == 42.0, "broadcast");

    Tensor in = full({n}, r + 1, kFloat32, g_device), out = zeros({n * w}, kFloat32, g_device);
    pg.allgather(out, in)->wait();
    auto g = out.to_vector<float>();
    for (int64_t i = 0; i < n * w; ++i) require(g[size_t(i)] == float(i / n + 1), "allgather");

    Tensor host = empty({n * w}, kFloat32), part = zeros({n}, kFloat32, g_device);
    {
      float* p = host.data<float>();
      for (int64_t i = 0; i < n * w; ++i) p[i] = float((i / n) * 10 + r + 1);  // chunk c: 10c + r + 1
    }
    Tensor big = host.to(g_device);
    pg.reduce_scatter(part, big)->wait();
    for (float v : part.to_vector<float>()) require(v == float(10 * r * w + sum), "reduce_scatter");
  }
  // A ring of sends: everyone passes its rank + 1 to the right. (NCCL needs such a send and
  // recv pair inside one group call, which the group does not offer yet.)
  if (w > 1 && g_device.is_cpu()) {
    Tensor mine = full({5}, r + 1, kFloat32, g_device), got = zeros({5}, kFloat32);
    auto s = pg.send(mine, (r + 1) % w);
    auto v = pg.recv(got, (r + w - 1) % w);
    s->wait();
    v->wait();
    for (float x : got.to_vector<float>()) require(x == float((r + w - 1) % w + 1), "send/recv");
  }
  pg.barrier();
  std::printf("collectives ok (%llu collectives)\n", static_cast<unsigned long long>(pg.sequence_number()));
}

// ---- the teaching ring over send/recv ------------------------------------------------------

// allreduce_ring_p2p: the closed-form sum (rank r contributes r + 1) at sizes tiny (1 element:
// empty chunks), odd (chunks of uneven length) and large, then random data against
// pg.allreduce (the same sum in another order: equal up to float rounding).
void run_ring(ProcessGroup& pg) {
  const int r = pg.rank(), w = pg.size();
  const double sum = w * (w + 1) / 2.0;
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(1000), int64_t(65539)}) {
    for (DType dt : {kFloat32, kFloat64, kInt64}) {
      Tensor t = full({n}, r + 1, dt, g_device);
      allreduce_ring_p2p(pg, t);
      for (double v : t.to(kFloat64).to_vector<double>()) require(v == sum, "ring closed-form sum");
    }
    Generator gen(1000 + uint64_t(r));
    Tensor mine = rand({n}, kFloat32, g_device, &gen);  // [0, 1): no cancellation in the sum
    Tensor ref = mine.clone();
    allreduce_ring_p2p(pg, mine);
    pg.allreduce(ref)->wait();
    auto a = mine.to_vector<float>(), b = ref.to_vector<float>();
    for (size_t i = 0; i < a.size(); ++i)
      require(std::abs(a[i] - b[i]) <= 1e-6f * std::abs(b[i]), "ring equals allreduce");
  }
  pg.barrier();
  std::printf("ring ok\n");
}

// ---- models and data -----------------------------------------------------------------------

std::shared_ptr<nn::Module> make_net(uint64_t seed, bool bn, int64_t classes = 5) {
  return test::dist_test_net(seed, bn, classes);
}

std::vector<std::pair<Tensor, Tensor>> make_batches(int steps, int64_t batch) {
  return test::dist_test_batches(steps, batch, g_device);
}

// Rank r's rows of a global batch of B: contiguous, sizes differing by at most one.
std::pair<int64_t, int64_t> shard(int64_t B, int r, int w) {
  const int64_t base = B / w, extra = B % w;
  const int64_t start = r * base + std::min<int64_t>(r, extra);
  return {start, start + base + (r < extra ? 1 : 0)};
}

// The loss of this rank's shard, scaled so that the average over ranks of the gradients is the
// gradient of the mean over the global batch (Note [loss scaling for uneven shards]).
Tensor shard_loss(nn::Module& net, const Tensor& x, const Tensor& y, int64_t B, int w, double extra_scale = 1.0) {
  Tensor loss = cross_entropy(net.forward(x), y);
  const double scale = double(w) * double(x.size(0)) / double(B) * extra_scale;
  return mul(loss, scale);
}

// The same through DDP's forward, which arms the backward that reduces (Note [the forward arms
// the reducer] in parallel/reducer.h; a forward of ddp.module() would leave it local).
Tensor shard_loss(DistributedDataParallel& ddp, const Tensor& x, const Tensor& y, int64_t B, int w,
                  double extra_scale = 1.0) {
  Tensor loss = cross_entropy(ddp(x), y);
  const double scale = double(w) * double(x.size(0)) / double(B) * extra_scale;
  return mul(loss, scale);
}

uint64_t params_hash(const nn::Module& m) { return test::dist_params_hash(m); }

double max_rel_err(const nn::Module& a, const nn::Module& b) {
  double worst = 0;
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t k = 0; k < pa.size(); ++k) {
    auto va = pa[k].to_vector<float>(), vb = pb[k].to_vector<float>();
    double scale = 1;
    for (float v : vb) scale = std::max(scale, double(std::abs(v)));
    for (size_t i = 0; i < va.size(); ++i) worst = std::max(worst, std::abs(double(va[i]) - vb[i]) / scale);
  }
  return worst;
}

// One process, the global batch: what DDP must reproduce. With BatchNorm every rank normalizes
// its own shard (as in PyTorch's DDP), so the reference runs the shards one after the other
// and accumulates — and, like DDP with broadcast_buffers, keeps rank 0's running statistics.
void reference_step(nn::Module& net, nn::optim::Optimizer& opt, const Tensor& x, const Tensor& y, int w, bool bn) {
  opt.zero_grad();
  const int64_t B = x.size(0);
  if (!bn) {
    cross_entropy(net.forward(x), y).backward();
  } else {
    const auto buffers = net.buffers();
    std::vector<Tensor> saved;
    for (int r = 0; r < w; ++r) {
      auto [s, e] = shard(B, r, w);
      if (r > 0) {
        saved.clear();
        for (const Tensor& b : buffers) saved.push_back(b.clone());
      }
      shard_loss(net, x.slice(0, s, e), y.slice(0, s, e), B, w, 1.0 / w).backward();
      if (r > 0) for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(saved[k]);
    }
  }
  opt.step();
}

void run_ddp(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  ProcessGroup& pg = *group;
  const bool bn = f.on("--bn");
  const int steps = int(f.num("--steps", 4));
  const int64_t B = f.num("--batch", 10);
  const int r = pg.rank(), w = pg.size();
  DistributedDataParallelOptions o;
  o.bucket_cap_mb = double(f.num("--bucket-kb", 1)) / 1024.0;  // tiny buckets: several per model
  o.first_bucket_cap_mb = o.bucket_cap_mb;
  o.overlap = !f.on("--no-overlap");
  DistributedDataParallel ddp(make_net(7 + r, bn), group, o);
  nn::optim::SGD opt(ddp.parameters(), 0.1, 0.9);
  auto batches = make_batches(steps, B);
  const long pause_ms = f.num("--pause-ms", 0);  // per step: keeps a job running for a while
  for (const auto& [x, y] : batches) {
    if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    auto [s, e] = shard(B, r, w);
    opt.zero_grad();
    shard_loss(ddp, x.slice(0, s, e), y.slice(0, s, e), B, w).backward();
    opt.step();
  }
  std::printf("buckets %zu\n", ddp.reducer().num_buckets());
  std::printf("params %016llx\n", static_cast<unsigned long long>(params_hash(ddp.module())));
  if (r == 0) {
    auto ref = make_net(7, bn);
    ref->to(g_device);
    nn::optim::SGD ref_opt(ref->parameters(), 0.1, 0.9);
    for (const auto& [x, y] : batches) reference_step(*ref, ref_opt, x, y, w, bn);
    const double err = max_rel_err(ddp.module(), *ref);
    std::printf("max_rel_err %.3g\n", err);
    require(err <= 1e-5, "DDP parameters equal the one-process reference to 1e-5");
  }
}


// K micro-batches of B, the first K-1 under no_sync: one update that equals one batch of K*B.
void run_no_sync(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  const int K = int(f.num("--accum", 3));
  const int64_t B = 8;
  const int r = group->rank(), w = group->size();
  DistributedDataParallel ddp(make_net(7 + r, false), group);
  nn::optim::SGD opt(ddp.parameters(), 0.1);
  auto micro = make_batches(K, B);
  opt.zero_grad();
  for (int k = 0; k < K; ++k) {
    auto [s, e] = shard(B, r, w);
    const Tensor x = micro[size_t(k)].first.slice(0, s, e), y = micro[size_t(k)].second.slice(0, s, e);
    if (k + 1 < K) {
      auto guard = ddp.no_sync();
      shard_loss(ddp, x, y, B, w, 1.0 / K).backward();
    } else {
      shard_loss(ddp, x, y, B, w, 1.0 / K).backward();
    }
  }
  require(ddp.reducer().reductions() == 1, "one reduction for K micro-batches");
  opt.step();
  std::printf("params %016llx\n", static_cast<unsigned long long>(params_hash(ddp.module())));
  if (r == 0) {
    std::vector<Tensor> xs, ys;
    for (const auto& [x, y] : micro) {
      xs.push_back(x);
      ys.push_back(y);
    }
    auto ref = make_net(7, false);
    ref->to(g_device);
    nn::optim::SGD ref_opt(ref->parameters(), 0.1);
    ref_opt.zero_grad();
    cross_entropy(ref->forward(cat(xs, 0)), cat(ys, 0)).backward();
    ref_opt.step();
    const double err = max_rel_err(ddp.module(), *ref);
    std::printf("max_rel_err %.3g\n", err);
    require(err <= 1e-5, "no_sync accumulation equals one batch K times larger");
  }
}

// Note [the forward arms the reducer] (parallel/reducer.h) across processes: rank 1 alone runs a
// backward through ddp.module() (no collective, its local gradients; rank 0 is not waiting);
// then on every rank a forward outside no_sync whose backward runs inside it (reduced: every
// rank prints the same "synced HASH") and a forward inside no_sync whose backward runs after it
// (local: no collective).
uint64_t grads_hash(const nn::Module& m) {
  uint64_t h = 1469598103934665603ull;
  for (const Tensor& p : m.parameters()) {
    for (float v : p.grad().to_vector<float>()) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      h = (h ^ bits) * 1099511628211ull;
    }
  }
  return h;
}

void require_local_grads(nn::Module& ddp_module, nn::Module& local, const Tensor& x, const Tensor& y,
                         const std::string& what) {
  local.zero_grad();
  cross_entropy(local.forward(x), y).backward();
  auto a = ddp_module.parameters(), b = local.parameters();
  for (size_t k = 0; k < a.size(); ++k) {
    require(a[k].grad().defined(), what + ": a gradient");
    auto ga = a[k].grad().to_vector<float>(), gb = b[k].grad().to_vector<float>();
    for (size_t i = 0; i < ga.size(); ++i)
      require(std::abs(ga[i] - gb[i]) <= 1e-6f * (1 + std::abs(gb[i])), what + ": the local gradient");
  }
}

void run_armed(const std::shared_ptr<ProcessGroup>& group) {
  ProcessGroup& pg = *group;
  const int r = pg.rank(), w = pg.size();
  const int64_t B = 8;
  DistributedDataParallel ddp(make_net(7 + r, false), group);
  std::shared_ptr<nn::Module> local = ddp.module().clone();  // rank 0's weights, outside DDP
  auto batches = make_batches(3, B);
  auto [s, e] = shard(B, r, w);
  auto x = [&](int k) { return batches[size_t(k)].first.slice(0, s, e); };
  auto y = [&](int k) { return batches[size_t(k)].second.slice(0, s, e); };
  if (r == 1) {
    const uint64_t seq = pg.sequence_number();
    ddp.module().zero_grad();
    cross_entropy(ddp.module().forward(x(0)), y(0)).backward();
    require(pg.sequence_number() == seq, "a backward through module() starts no collective");
    require(ddp.reducer().reductions() == 0, "a backward through module() reduces nothing");
    require_local_grads(ddp.module(), *local, x(0), y(0), "backward through module()");
  }
  ddp.module().zero_grad();
  Tensor loss = cross_entropy(ddp(x(1)), y(1));
  {
    auto guard = ddp.no_sync();  // after the forward: changes nothing
    loss.backward();
  }
  require(ddp.reducer().reductions() == 1, "a forward outside no_sync: its backward inside is reduced");
  std::printf("synced %016llx\n", static_cast<unsigned long long>(grads_hash(ddp.module())));
  ddp.module().zero_grad();
  {
    auto guard = ddp.no_sync();
    loss = cross_entropy(ddp(x(2)), y(2));
  }
  const uint64_t seq = pg.sequence_number();
  loss.backward();  // after the guard: still local
  require(pg.sequence_number() == seq, "a forward inside no_sync: its backward after it starts no collective");
  require(ddp.reducer().reductions() == 1, "a forward inside no_sync: its backward after it reduces nothing");
  require_local_grads(ddp.module(), *local, x(2), y(2), "forward inside no_sync");
  pg.barrier();
  std::printf("armed ok\n");
}

// A model whose second head the loss never uses.
class TwoHeads : public nn::Cloneable<TwoHeads> {
 public:
  explicit TwoHeads(Generator& gen) {
    used_ = register_module("used", std::make_shared<nn::Linear>(8, 4, true, gen));
    unused_ = register_module("unused", std::make_shared<nn::Linear>(8, 4, true, gen));
  }
  TwoHeads(const TwoHeads& o) : nn::Cloneable<TwoHeads>(o), used_(child("used")), unused_(child("unused")) {}
  std::string name() const override { return "TwoHeads"; }

 protected:
  Tensor forward_impl(const Tensor& x) override { return used_->forward(x); }

 private:
  std::shared_ptr<nn::Module> used_, unused_;
};

void run_unused(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  Generator gen(3);
  DistributedDataParallelOptions o;
  o.find_unused_parameters = f.on("--find-unused");
  DistributedDataParallel ddp(std::make_shared<TwoHeads>(gen), group, o);
  nn::optim::SGD opt(ddp.parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    Tensor x = randn({4, 8}, kFloat32, kCPU, &gen).to(g_device);
    Tensor y = from_vector<int64_t>({0, 1, 2, 3}, {4}, g_device);
    opt.zero_grad();
    cross_entropy(ddp(x), y).backward();
    opt.step();
  }
  std::printf("unused ok\n");
}

// Rank 1 builds its last layer with 6 outputs instead of 5.
void run_mismatch(const std::shared_ptr<ProcessGroup>& group) {
  DistributedDataParallel ddp(make_net(7, false, group->rank() == 1 ? 6 : 5), group);
  std::printf("mismatch not detected\n");
}

// A long run in which one rank dies without a word at a given step.
void run_kill(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  const int kill_rank = int(f.num("--kill-rank", 1)), kill_step = int(f.num("--kill-step", 3));
  const int r = group->rank(), w = group->size();
  DistributedDataParallel ddp(make_net(7, false), group);
  nn::optim::SGD opt(ddp.parameters(), 0.1);
  auto batches = make_batches(4, 12);
  for (int step = 0; step < 100000; ++step) {
    if (r == kill_rank && step == kill_step) std::raise(SIGKILL);
    const auto& [x, y] = batches[size_t(step % 4)];
    auto [s, e] = shard(12, r, w);
    opt.zero_grad();
    shard_loss(ddp, x.slice(0, s, e), y.slice(0, s, e), 12, w).backward();
    opt.step();
  }
}

// Rank 1 reduces a tensor of another size than the others: caught by the fingerprints.
void run_fingerprint(const std::shared_ptr<ProcessGroup>& group) {
  const int64_t n = group->rank() == 1 ? 20 : 10;
  Tensor t = ones({n}, kFloat32, g_device);
  group->allreduce(t)->wait();
  std::printf("fingerprint mismatch not detected\n");
}

// Rank 1 stops calling collectives after a few (alive, but silent): the others must time out
// naming the collective and rank 1.
void run_silent(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  const int silent_after = int(f.num("--after", 3));
  for (int k = 0;; ++k) {
    if (group->rank() == 1 && k == silent_after) {
      std::this_thread::sleep_for(std::chrono::seconds(int(f.num("--sleep", 30))));
      return;
    }
    Tensor t = ones({4}, kFloat32, g_device);
    group->allreduce(t)->wait();
    if (k > 1000000) return;
  }
}

// ---- ZeRO (parallel/sharded/zero_optimizer.h) -----------------------------------------------

// 7 classes: 40 + 2320 + 119 = 2479 parameters, divisible by neither 2 nor 3 (padded shards).
constexpr int64_t kZeroClasses = 7;

// The plain optimizer and the ZeRO optimizer class of --optim, with the same hyperparameters.
std::string zero_optim_name(const Flags& f) {
  for (size_t i = 0; i + 1 < f.args.size(); ++i) if (f.args[i] == "--optim") return f.args[i + 1];
  return "adam";
}

std::unique_ptr<nn::optim::Optimizer> zero_plain_optimizer(const std::string& name, std::vector<Tensor> params) {
  if (name == "sgd") return std::make_unique<nn::optim::SGD>(std::move(params), nn::optim::SGDOptions(0.1).momentum(0.9));
  if (name == "adam") return std::make_unique<nn::optim::Adam>(std::move(params), nn::optim::AdamOptions(1e-2));
  if (name == "adamw")
    return std::make_unique<nn::optim::AdamW>(std::move(params), nn::optim::AdamWOptions(1e-2).weight_decay(0.1));
  throw std::runtime_error("unknown --optim " + name);
}

parallel::sharded::ZeroRedundancyOptimizerOptions zero_options(const Flags& f) {
  parallel::sharded::ZeroRedundancyOptimizerOptions o;
  o.stage = int(f.num("--stage", 1));
  if (f.num("--bucket-kb", 0) > 0) o.bucket_cap_mb = double(f.num("--bucket-kb", 0)) / 1024.0;
  o.gradients_reduced = f.on("--ddp");
  return o;
}

std::unique_ptr<parallel::sharded::ZeroRedundancyOptimizer> make_zero(const std::vector<Tensor>& params,
                                                                     const std::shared_ptr<ProcessGroup>& group,
                                                                     const Flags& f) {
  const std::string name = zero_optim_name(f);
  auto factory = [name](std::vector<Tensor> p) { return zero_plain_optimizer(name, std::move(p)); };
  return std::make_unique<parallel::sharded::ZeroRedundancyOptimizer>(params, factory, group, zero_options(f));
}

// max over tensors of max|a - b| / max|b|: relative to each tensor's largest value.
double zero_rel_err(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  require(a.size() == b.size(), "same number of tensors");
  double worst = 0;
  for (size_t k = 0; k < a.size(); ++k) {
    auto va = a[k].to(kFloat64).to_vector<double>(), vb = b[k].to(kFloat64).to_vector<double>();
    require(va.size() == vb.size(), "same sizes");
    double scale = 1e-30, diff = 0;
    for (size_t i = 0; i < va.size(); ++i) {
      scale = std::max(scale, std::abs(vb[i]));
      diff = std::max(diff, std::abs(va[i] - vb[i]));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

void run_zero(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  const int steps = int(f.num("--steps", 4));
  const int64_t B = f.num("--batch", 10);
  const int r = group->rank(), w = group->size();
  const std::string optim = zero_optim_name(f);
  auto batches = make_batches(steps, B);
  // ZeRO: on the bare module (or beside DDP with --ddp); every rank starts from other weights,
  // the optimizer (or DDP) broadcasts rank 0's.
  auto net = make_net(7 + r, false, kZeroClasses);
  net->to(g_device);
  std::unique_ptr<DistributedDataParallel> zddp;
  if (f.on("--ddp")) zddp = std::make_unique<DistributedDataParallel>(net, group);
  auto zero = make_zero(net->parameters(), group, f);
  // DDP with the plain optimizer, in the same ranks.
  DistributedDataParallelOptions o;
  o.bucket_cap_mb = o.first_bucket_cap_mb = 1.0 / 1024.0;
  DistributedDataParallel ddp(make_net(7 + r, false, kZeroClasses), group, o);
  auto ddp_opt = zero_plain_optimizer(optim, ddp.parameters());
  for (const auto& [x, y] : batches) {
    auto [s, e] = shard(B, r, w);
    zero->zero_grad();
    // Beside DDP its forward arms the reducer (Note [the forward arms the reducer]).
    (zddp ? shard_loss(*zddp, x.slice(0, s, e), y.slice(0, s, e), B, w)
          : shard_loss(*net, x.slice(0, s, e), y.slice(0, s, e), B, w))
        .backward();
    zero->step();
    ddp_opt->zero_grad();
    shard_loss(ddp, x.slice(0, s, e), y.slice(0, s, e), B, w).backward();
    ddp_opt->step();
  }
  const double vs_ddp = zero_rel_err(net->parameters(), ddp.parameters());
  std::printf("buckets %zu\n", zero->num_buckets());
  std::printf("zero_vs_ddp %.3g\n", vs_ddp);
  std::printf("params %016llx\n", static_cast<unsigned long long>(params_hash(*net)));
  std::printf("%s\n", zero->memory().str().c_str());
  zero->consolidate_state_dict(0);
  require(vs_ddp <= 1e-6, "ZeRO parameters equal DDP's to 1e-6");
  if (r == 0) {
    auto ref = make_net(7, false, kZeroClasses);
    ref->to(g_device);
    auto ref_opt = zero_plain_optimizer(optim, ref->parameters());
    for (const auto& [x, y] : batches) reference_step(*ref, *ref_opt, x, y, w, false);
    const double vs_ref = zero_rel_err(net->parameters(), ref->parameters());
    const nn::StateDict mine = zero->state_dict(), theirs = ref_opt->state_dict();
    require(mine.keys() == theirs.keys(), "consolidated state has the plain optimizer's names");
    const double vs_state = zero_rel_err(mine.values(), theirs.values());
    std::printf("zero_vs_ref %.3g\n", vs_ref);
    std::printf("state_vs_ref %.3g (%zu tensors)\n", vs_state, mine.size());
    require(vs_ref <= 1e-6, "ZeRO parameters equal one process's to 1e-6");
    require(vs_state <= 1e-5, "the consolidated state equals one process's optimizer state to 1e-5");
  } else {
    bool threw = false;
    try {
      zero->state_dict();
    } catch (const Error&) {
      threw = true;
    }
    require(threw, "state_dict on a rank that holds no consolidated state is an error");
  }
  // Resume: every rank consolidates the state to itself in turn and loads it into a fresh ZeRO
  // optimizer over a copy of the parameters; one more step of both gives the same bits.
  nn::StateDict full = r == 0 ? zero->state_dict() : nn::StateDict();
  for (int to = 1; to < w; ++to) {
    zero->consolidate_state_dict(to);
    if (to == r) full = zero->state_dict();
  }
  auto net2 = make_net(100 + r, false, kZeroClasses);
  net2->to(g_device);
  {
    NoGradGuard no_grad;
    auto p1 = net->parameters(), p2 = net2->parameters();
    for (size_t k = 0; k < p1.size(); ++k) p2[k].copy_(p1[k]);
  }
  std::unique_ptr<DistributedDataParallel> zddp2;
  if (f.on("--ddp")) zddp2 = std::make_unique<DistributedDataParallel>(net2, group);
  auto zero2 = make_zero(net2->parameters(), group, f);
  zero2->load_state_dict(full);
  const auto& [x, y] = batches[0];
  auto [s, e] = shard(B, r, w);
  for (auto* z : {zero.get(), zero2.get()}) {
    nn::Module& m = z == zero.get() ? *net : *net2;
    DistributedDataParallel* d = z == zero.get() ? zddp.get() : zddp2.get();
    z->zero_grad();
    (d ? shard_loss(*d, x.slice(0, s, e), y.slice(0, s, e), B, w)
       : shard_loss(m, x.slice(0, s, e), y.slice(0, s, e), B, w))
        .backward();
    z->step();
  }
  const double resumed = zero_rel_err(net2->parameters(), net->parameters());
  std::printf("resume_vs_zero %.3g\n", resumed);
  require(resumed == 0, "a ZeRO optimizer resumed from the consolidated state steps to the same bits");
}

void print_zero_memory(const char* when, const parallel::sharded::ZeroRedundancyOptimizer& zero) {
  const auto m = zero.memory();
  // live / peak: the allocator's bytes on the rank's device now and at most since the step
  // began (everything the process holds: batches, activations and Gloo's buffers too).
  std::printf("zero-memory %s world %d stage %d numel %lld shard %lld params %lld shard_params %lld grads %lld "
              "state %lld ddp_params %lld ddp_grads %lld ddp_state %lld live %lld peak %lld\n",
              when, m.world_size, m.stage, (long long)m.numel, (long long)m.shard_numel, (long long)m.parameters,
              (long long)m.shard_parameters, (long long)m.gradients, (long long)m.optimizer_state,
              (long long)m.ddp_parameters, (long long)m.ddp_gradients, (long long)m.ddp_optimizer_state,
              (long long)allocated_bytes(g_device), (long long)max_allocated_bytes(g_device));
  std::printf("%s %s\n", when, m.str().c_str());
}

void run_zero_memory(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  const int r = group->rank(), w = group->size();
  auto net = make_net(7 + r, false, kZeroClasses);
  net->to(g_device);
  auto zero = make_zero(net->parameters(), group, f);
  const int64_t B = 6;
  auto batches = make_batches(2, B);
  for (const auto& [x, y] : batches) {
    auto [s, e] = shard(B, r, w);
    zero->zero_grad();
    reset_max_allocated_bytes(g_device);
    shard_loss(*net, x.slice(0, s, e), y.slice(0, s, e), B, w).backward();
    print_zero_memory("after-backward", *zero);
    zero->step();
    print_zero_memory("after-step", *zero);
  }
  std::printf("buckets %zu:", zero->num_buckets());
  for (size_t b = 0; b < zero->num_buckets(); ++b) std::printf(" %lld", (long long)zero->bucket_numel(b));
  std::printf("\n");
}

// Rank 1 dies at step 2: before its reduce-scatter (--kill-at reduce) or between it and the
// all-gather (--kill-at gather). The others are then inside that collective.
void run_zero_kill(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  const bool at_gather = [&] {
    for (size_t i = 0; i + 1 < f.args.size(); ++i) if (f.args[i] == "--kill-at") return f.args[i + 1] == "gather";
    return false;
  }();
  const int r = group->rank(), w = group->size();
  auto net = make_net(7, false, kZeroClasses);
  net->to(g_device);
  auto zero = make_zero(net->parameters(), group, f);
  auto batches = make_batches(4, 12);
  for (int step = 0; step < 100000; ++step) {
    const bool die = r == 1 && step == 2;
    if (die && !at_gather) std::raise(SIGKILL);
    const auto& [x, y] = batches[size_t(step % 4)];
    auto [s, e] = shard(12, r, w);
    zero->zero_grad();
    shard_loss(*net, x.slice(0, s, e), y.slice(0, s, e), 12, w).backward();
    if (die) {
      zero->reduce_gradients();
      std::raise(SIGKILL);
    }
    zero->step();
  }
}

// ---- FSDP (parallel/sharded/fsdp.h) ------------------------------------------------------------

void print_fsdp_memory(const char* when, const parallel::sharded::FullyShardedDataParallel& fsdp) {
  const auto m = fsdp.memory();
  std::printf("fsdp-memory %s world %d numel %lld shard %lld params %lld flat %lld grads %lld live %lld\n", when,
              m.world_size, (long long)m.numel, (long long)m.shard_numel, (long long)m.parameters,
              (long long)m.flat_parameters, (long long)m.gradients, (long long)allocated_bytes(g_device));
  std::printf("%s %s\n", when, m.str().c_str());
}

void run_fsdp(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  using parallel::sharded::ShardingStrategy;
  const int steps = int(f.num("--steps", 4));
  const int64_t B = f.num("--batch", 10);
  const int r = group->rank(), w = group->size();
  const std::string optim = zero_optim_name(f);
  parallel::sharded::FullyShardedDataParallelOptions fo;
  fo.sharding_strategy = f.on("--no-shard") ? ShardingStrategy::NO_SHARD : ShardingStrategy::SHARD_GRAD_OP;
  auto batches = make_batches(steps, B);
  auto net = make_net(7 + r, false, kZeroClasses);
  net->to(g_device);
  parallel::sharded::FullyShardedDataParallel fsdp(net, group, fo);
  auto opt = zero_plain_optimizer(optim, fsdp.parameters());
  DistributedDataParallel ddp(make_net(7 + r, false, kZeroClasses), group);
  auto ddp_opt = zero_plain_optimizer(optim, ddp.parameters());
  print_fsdp_memory("rest", fsdp);
  for (const auto& [x, y] : batches) {
    auto [s, e] = shard(B, r, w);
    const Tensor xs = x.slice(0, s, e), ys = y.slice(0, s, e);
    const double scale = double(w) * double(xs.size(0)) / double(B);
    opt->zero_grad();
    mul(cross_entropy(fsdp(xs), ys), scale).backward();
    print_fsdp_memory("after-backward", fsdp);
    opt->step();
    ddp_opt->zero_grad();
    shard_loss(ddp, xs, ys, B, w).backward();
    ddp_opt->step();
  }
  print_fsdp_memory("rest", fsdp);
  // Evaluation without gradients: each unit gathered for its forward and released after.
  Tensor out, ref_out;
  {
    NoGradGuard no_grad;
    out = fsdp(batches[0].first);
    ref_out = ddp.module().forward(batches[0].first);
  }
  print_fsdp_memory("after-eval", fsdp);
  const double eval_err = zero_rel_err({out}, {ref_out});
  std::printf("fsdp_eval_vs_ddp %.3g\n", eval_err);
  require(eval_err <= 1e-6, "FSDP's no-grad forward equals DDP's to 1e-6");
  std::printf("units %zu:", fsdp.num_units());
  for (size_t u = 0; u < fsdp.num_units(); ++u) std::printf(" %lld", (long long)fsdp.unit_numel(u));
  std::printf("\n");
  auto full = fsdp.summon_full_params();
  const double vs_ddp = zero_rel_err(net->parameters(), ddp.parameters());
  std::printf("fsdp_vs_ddp %.3g\n", vs_ddp);
  std::printf("params %016llx\n", static_cast<unsigned long long>(params_hash(*net)));
  require(vs_ddp <= 1e-6, "FSDP parameters equal DDP's to 1e-6");
  if (r == 0) {
    auto ref = make_net(7, false, kZeroClasses);
    ref->to(g_device);
    auto ref_opt = zero_plain_optimizer(optim, ref->parameters());
    for (const auto& [x, y] : batches) reference_step(*ref, *ref_opt, x, y, w, false);
    const double vs_ref = zero_rel_err(net->parameters(), ref->parameters());
    std::printf("fsdp_vs_ref %.3g\n", vs_ref);
    require(vs_ref <= 1e-6, "FSDP parameters equal one process's to 1e-6");
  }
}

// ---- subgroups (4 ranks) -------------------------------------------------------------------

struct Grid {
  std::shared_ptr<ProcessGroup> row, col;  // {0,1} or {2,3}; {0,2} or {1,3}
};

// Every rank makes all four groups, in the same order; each gets one row and one column.
Grid make_grid(ProcessGroup& world) {
  require(world.size() == 4, "the subgroup modes run on 4 ranks");
  Grid g;
  for (const std::vector<int>& ranks : {std::vector<int>{0, 1}, {2, 3}}) {
    if (auto sub = world.new_group(ranks)) g.row = sub;
  }
  for (const std::vector<int>& ranks : {std::vector<int>{2, 0}, {3, 1}}) {  // any order: sorted
    if (auto sub = world.new_group(ranks)) g.col = sub;
  }
  require(g.row && g.col && g.row->size() == 2 && g.col->size() == 2, "one row and one column per rank");
  return g;
}

// The sum over a group of (global rank + 1).
double group_sum(const ProcessGroup& g) {
  double s = 0;
  for (int r : g.global_ranks()) s += r + 1;
  return s;
}

void run_subgroups(ProcessGroup& world) {
  Grid g = make_grid(world);
  const int me = world.rank();
  for (int iter = 0; iter < 5; ++iter) {
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(65539)}) {
      // Issued together, waited together: the row's, the column's and the world's collectives
      // are in flight at the same time, on three engines.
      Tensor a = full({n}, me + 1, kFloat32);                        // row allreduce (sum)
      Tensor in = full({n}, me + 1, kFloat64), out = zeros({2 * n}, kFloat64);  // column allgather
      Tensor b = full({n}, g.row->rank() == 1 ? 100.0 + me : -1.0, kInt64);  // row broadcast from 1
      Tensor c = full({n}, me + 1, kFloat32);                        // column average
      Tensor w = full({n}, me + 1, kFloat32);                        // world max
      std::vector<WorkPtr> works = {g.row->allreduce(a), g.col->allgather(out, in), g.row->broadcast(b, 1),
                                    g.col->allreduce(c, ReduceOp::Avg), world.allreduce(w, ReduceOp::Max)};
      for (auto& work : works) work->wait();
      for (float v : a.to_vector<float>()) require(v == float(group_sum(*g.row)), "row sum");
      const auto got = out.to_vector<double>();
      for (int64_t i = 0; i < 2 * n; ++i)
        require(got[size_t(i)] == g.col->global_rank(int(i / n)) + 1, "column allgather in column rank order");
      for (int64_t v : b.to_vector<int64_t>()) require(v == 100 + g.row->global_rank(1), "row broadcast");
      for (float v : c.to_vector<float>()) require(v == float(group_sum(*g.col) / 2), "column avg");
      for (float v : w.to_vector<float>()) require(v == 4.0f, "world max");
    }
  }
  g.row->barrier();
  g.col->barrier();
  world.barrier();
  std::printf("subgroups ok (row %d, column %d)\n", g.row->global_rank(0), g.col->global_rank(0));
}

void run_subgroup_fingerprint(ProcessGroup& world) {
  Grid g = make_grid(world);
  Tensor t = ones({world.rank() == 3 ? 20 : 10});
  g.row->allreduce(t)->wait();
  std::printf("row of %d ok\n", g.row->global_rank(0));
  if (g.row->global_rank(0) == 0) return;  // the healthy row
  std::printf("fingerprint mismatch not detected\n");
}

void run_subgroup_kill(ProcessGroup& world) {
  Grid g = make_grid(world);
  for (int k = 0; k < 100000; ++k) {
    if (world.rank() == 3 && k == 5) std::raise(SIGKILL);
    Tensor t = ones({1000});
    g.row->allreduce(t)->wait();
    if (g.row->global_rank(0) == 0 && k == 20) {
      std::printf("row of 0 ok\n");
      return;
    }
  }
}


// ---- SyncBatchNorm ---------------------------------------------------------------------------

// The largest |a - b| over two tensors of one shape (0 for empty ones), read as float64.
double max_abs_diff(const Tensor& a, const Tensor& b) {
  require(a.shape() == b.shape(), "shapes " + shape_str(a.shape()) + " vs " + shape_str(b.shape()));
  auto va = a.to(kCPU).to(kFloat64).contiguous().to_vector<double>();
  auto vb = b.to(kCPU).to(kFloat64).contiguous().to_vector<double>();
  double worst = 0;
  for (size_t i = 0; i < va.size(); ++i) worst = std::max(worst, std::abs(va[i] - vb[i]));
  return worst;
}

// This rank's local gradient summed over the group: what DDP's allreduce hands the optimizer
// (times the group size, which averages).
Tensor summed(const std::shared_ptr<ProcessGroup>& group, const Tensor& t) {
  Tensor s = t.clone();
  group->allreduce(s)->wait();
  return s;
}

// syncbn --sizes a,b,...: rank r holds rows [a + ... , + sizes[r]) of one global batch (sizes may
// be 0). Checks, for several training steps and then eval, that SyncBatchNorm gives what one
// process's BatchNorm2d gives on the global batch: the op in float64 against tandem's
// batch_norm (within 1e-9), the module in float32 against a BatchNorm2d (within 1e-4), and
// exactly one collective per training forward, one per backward, none in eval.
void run_syncbn(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  const int r = group->rank(), w = group->size();
  std::vector<int64_t> sizes;
  for (size_t i = 0; i + 1 < f.args.size(); ++i) {
    if (f.args[i] != "--sizes") continue;
    std::string list = f.args[i + 1];
    for (size_t at = 0; at <= list.size();) {
      size_t comma = list.find(',', at);
      if (comma == std::string::npos) comma = list.size();
      sizes.push_back(std::stol(list.substr(at, comma - at)));
      at = comma + 1;
    }
  }
  require(int(sizes.size()) == w, "--sizes lists one shard size per rank");
  int64_t B = 0, start = 0;
  for (int k = 0; k < w; ++k) {
    if (k < r) start += sizes[size_t(k)];
    B += sizes[size_t(k)];
  }
  const int64_t n = sizes[size_t(r)], C = 3;
  const Shape shape{B, C, 3, 2};
  Generator gen(11);  // the same global tensors on every rank
  const Tensor X = randn(shape, kFloat64, g_device, &gen), R = randn(shape, kFloat64, g_device, &gen);
  const Tensor gamma0 = randn({C}, kFloat64, g_device, &gen), beta0 = randn({C}, kFloat64, g_device, &gen);
  const int steps = int(f.num("--steps", 3));
  double err64 = 0, err32 = 0;
  auto track64 = [&](const Tensor& a, const Tensor& b) { err64 = std::max(err64, max_abs_diff(a, b)); };
  auto track32 = [&](const Tensor& a, const Tensor& b) { err32 = std::max(err32, max_abs_diff(a, b)); };

  // float64: the op against tandem's batch_norm on the whole batch.
  Tensor rm = zeros({C}, kFloat64, g_device), rv = ones({C}, kFloat64, g_device);
  Tensor rm_ref = rm.clone(), rv_ref = rv.clone();
  for (int step = 0; step < steps; ++step) {
    const Tensor Xs = add(mul(X, double(step + 1)), double(step)).detach();  // another batch each step
    Tensor x = Xs.slice(0, start, start + n).clone(), g = gamma0.clone(), b = beta0.clone();
    x.set_requires_grad(true), g.set_requires_grad(true), b.set_requires_grad(true);
    Tensor xr = Xs.clone(), gr = gamma0.clone(), br = beta0.clone();
    xr.set_requires_grad(true), gr.set_requires_grad(true), br.set_requires_grad(true);
    const uint64_t seq0 = group->sequence_number();
    Tensor y = nn::sync_batch_norm(x, g, b, rm, rv, 0.1, 1e-5, group);
    require(group->sequence_number() == seq0 + 1, "one collective in the forward");
    sum(mul(y, R.slice(0, start, start + n))).backward();
    require(group->sequence_number() == seq0 + 2, "one collective in the backward");
    Tensor yr = batch_norm(xr, gr, br, rm_ref, rv_ref, true, 0.1, 1e-5);
    sum(mul(yr, R)).backward();
    track64(y, yr.slice(0, start, start + n));
    track64(x.grad(), xr.grad().slice(0, start, start + n));
    track64(summed(group, g.grad()), gr.grad());
    track64(summed(group, b.grad()), br.grad());
    track64(rm, rm_ref);
    track64(rv, rv_ref);
  }

  // float32: the module against BatchNorm2d, then eval with the running statistics.
  nn::SyncBatchNorm sbn(C, 1e-5, 0.1, group);
  nn::BatchNorm2d ref(C);
  sbn.to(g_device), ref.to(g_device);
  for (nn::BatchNorm2d* m : {static_cast<nn::BatchNorm2d*>(&sbn), &ref}) {
    m->weight().detach().copy_(gamma0.to(kFloat32)), m->bias().detach().copy_(beta0.to(kFloat32));
  }
  const Tensor X32 = X.to(kFloat32), R32 = R.to(kFloat32);
  for (int step = 0; step < steps; ++step) {
    Tensor x = X32.slice(0, start, start + n).clone(), xr = X32.clone();
    x.set_requires_grad(true), xr.set_requires_grad(true);
    sbn.zero_grad(), ref.zero_grad();
    Tensor y = sbn(x);
    sum(mul(y, R32.slice(0, start, start + n))).backward();
    Tensor yr = ref(xr);
    sum(mul(yr, R32)).backward();
    track32(y, yr.slice(0, start, start + n));
    track32(x.grad(), xr.grad().slice(0, start, start + n));
    track32(summed(group, sbn.weight().grad()), ref.weight().grad());
    track32(summed(group, sbn.bias().grad()), ref.bias().grad());
    track32(sbn.running_mean(), ref.running_mean());
    track32(sbn.running_var(), ref.running_var());
    require(max_abs_diff(sbn.num_batches_tracked(), ref.num_batches_tracked()) == 0, "num_batches_tracked");
  }
  {
    // A Residual block's join (forward_add_relu): over a group, relu(sync batch norm + residual)
    // as two ops, against BatchNorm2d's fused op on the whole batch.
    Tensor x = X32.slice(0, start, start + n).clone(), xr = X32.clone();
    Tensor res = R32.slice(0, start, start + n).clone(), resr = R32.clone();
    for (Tensor* t : {&x, &xr, &res, &resr}) t->set_requires_grad(true);
    sbn.zero_grad(), ref.zero_grad();
    const Tensor y = sbn.forward_add_relu(x, res);
    sum(mul(y, y)).backward();
    const Tensor yr = ref.forward_add_relu(xr, resr);
    sum(mul(yr, yr)).backward();
    track32(y, yr.slice(0, start, start + n));
    track32(x.grad(), xr.grad().slice(0, start, start + n));
    track32(res.grad(), resr.grad().slice(0, start, start + n));
    track32(summed(group, sbn.weight().grad()), ref.weight().grad());
    track32(sbn.running_mean(), ref.running_mean());
  }
  sbn.eval(), ref.eval();
  const uint64_t seq0 = group->sequence_number();
  const Tensor x = X32.slice(0, start, start + n).clone();
  track32(sbn(x), ref(x));
  require(group->sequence_number() == seq0, "no collective in eval mode");
  require(err64 <= 1e-9, "float64 error " + std::to_string(err64) + " > 1e-9");
  require(err32 <= 1e-4, "float32 error " + std::to_string(err32) + " > 1e-4");
  std::printf("syncbn ok rank %d rows %lld f64_err %.3g f32_err %.3g\n", r, static_cast<long long>(n), err64, err32);
}

// syncbn-kill [--kill-rank R] [--kill-step S]: SyncBatchNorm training in which rank R SIGKILLs
// itself at the start of step S, while the others wait in the forward's allgather.
void run_syncbn_kill(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  const int kill_rank = int(f.num("--kill-rank", 1)), kill_step = int(f.num("--kill-step", 2));
  nn::SyncBatchNorm sbn(4, 1e-5, 0.1, group);
  sbn.to(g_device);
  Generator gen(3);
  const Tensor x = randn({6, 4, 2, 2}, kFloat32, g_device, &gen);
  for (int step = 0; step < 100000; ++step) {
    if (group->rank() == kill_rank && step == kill_step) std::raise(SIGKILL);
    sum(sbn(x)).backward();
  }
}

// ---- one pipeline stage per process ------------------------------------------------------

// max |a - b| / max(1, max |b|), as the tests' rel_error.
double rel_err(const Tensor& a, const Tensor& b) {
  const auto va = a.to(kCPU).to(kFloat64).to_vector<double>(), vb = b.to(kCPU).to(kFloat64).to_vector<double>();
  double diff = 0, scale = 1;
  for (size_t i = 0; i < va.size(); ++i) {
    diff = std::max(diff, std::abs(va[i] - vb[i]));
    scale = std::max(scale, std::abs(vb[i]));
  }
  return diff / scale;
}

// The pipeline and grid modes: the same LeNet, optimizer (--adam or SGD with momentum) and
// random batches on every rank, and for the one-process reference.
std::shared_ptr<nn::SequentialImpl> pipeline_test_model() {
  Generator gen(21);
  return nn::models::lenet({nn::models::LeNetActivation::ReLU, 10}, gen);
}

std::unique_ptr<nn::optim::Optimizer> pipeline_test_optimizer(const Flags& f, std::vector<Tensor> ps) {
  if (f.on("--adam")) return std::make_unique<nn::optim::Adam>(std::move(ps), 1e-3);
  return std::make_unique<nn::optim::SGD>(std::move(ps), 0.1, 0.9);
}

std::vector<std::pair<Tensor, Tensor>> pipeline_test_batches(int steps, int64_t batch) {
  Generator data_gen(22);
  std::vector<std::pair<Tensor, Tensor>> batches;
  for (int i = 0; i < steps; ++i) {
    Tensor x = randn({batch, 1, 28, 28}, kFloat32, kCPU, &data_gen);
    std::vector<int64_t> labels(static_cast<size_t>(batch));
    for (auto& l : labels) l = static_cast<int64_t>(data_gen.next_u64() % 10);
    batches.push_back({x, from_vector<int64_t>(labels, {batch})});
  }
  return batches;
}

// LeNet (12 layers) as {7, 5} on 2 ranks, {3, 3, 3, 3} on 4, else as even as possible.
void run_pipeline(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  namespace pp = tandem::parallel::pipeline;
  const int P = group->size(), s = group->rank();
  const int M = int(f.num("--micro-batches", 4)), steps = int(f.num("--steps", 3));
  const int64_t batch = f.num("--batch", 11);
  const int kill_rank = int(f.num("--kill-rank", -1)), kill_step = int(f.num("--kill-step", 1));
  std::string kind = "1f1b";
  for (size_t i = 0; i + 1 < f.args.size(); ++i) if (f.args[i] == "--schedule") kind = f.args[i + 1];
  auto make_model = pipeline_test_model;
  auto make_opt = [&](std::vector<Tensor> ps) { return pipeline_test_optimizer(f, std::move(ps)); };
  const std::vector<std::pair<Tensor, Tensor>> batches = pipeline_test_batches(steps, batch);
  // The reference: the whole model on this process's CPU.
  auto one = make_model();
  std::vector<double> one_losses;
  {
    auto opt = make_opt(one->parameters());
    for (const auto& [x, y] : batches) {
      opt->zero_grad();
      Tensor loss = cross_entropy(one->forward(x), y);
      loss.backward();
      opt->step();
      one_losses.push_back(loss.item());
    }
  }
  std::vector<int64_t> balance;
  const int64_t layers = 12;
  if (P == 2) balance = {7, 5};
  else for (int k = 0; k < P; ++k) balance.push_back(layers / P + (k < layers % P ? 1 : 0));
  auto model = make_model();
  const pp::Stage stage = pp::stage_of_balance(*model, balance, s, g_device);
  pp::ProcessPipeline pipe(stage, pp::schedule_by_name(kind, P, M),
                           [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); }, group);
  auto opt = make_opt(stage.module->parameters());
  double loss_err = 0;
  for (int k = 0; k < steps; ++k) {
    if (s == kill_rank && k == kill_step) std::raise(SIGKILL);
    opt->zero_grad();
    std::vector<Tensor> per_micro_batch;
    const double loss = pipe.step(batches[size_t(k)].first, batches[size_t(k)].second, &per_micro_batch).item();
    require(per_micro_batch.size() == size_t(M), "one loss per micro-batch");
    loss_err = std::max(loss_err, std::abs(loss - one_losses[size_t(k)]) / one_losses[size_t(k)]);
    opt->step();
  }
  if (kill_rank >= 0) {  // the survivors go on until the failure reaches them
    for (int k = 0; k < 100000; ++k) pipe.step(batches[0].first, batches[0].second);
  }
  // This stage's layers against the same layers of the one-device model.
  double err = 0;
  for (size_t l = stage.begin; l < stage.end; ++l) {
    const auto a = (*model)[l]->parameters(), b = (*one)[l]->parameters();
    require(a.size() == b.size(), "same layers");
    for (size_t i = 0; i < a.size(); ++i) err = std::max(err, rel_err(a[i], b[i]));
  }
  {
    NoGradGuard no_grad;
    Tensor out = pipe.forward(batches[0].first);
    require(rel_err(out, one->forward(batches[0].first)) < 1e-4, "forward equals the one-device model");
  }
  std::printf("stage %d max_rel_err %.3g loss_err %.3g in_flight %d\n", s, err, loss_err, pipe.max_in_flight());
}

// Stage 1 answers stage 0's activation [2, 3] with a gradient [3, 2], then stage 0 sends
// micro-batch 1 where stage 1 waits for micro-batch 0: both receivers must say so.
void run_pipeline_messages(const std::shared_ptr<ProcessGroup>& group) {
  namespace pp = tandem::parallel::pipeline;
  require(group->size() == 2, "2 ranks");
  pp::ProcessBoundary b(group);
  auto caught = [](const char* what, auto&& f) {
    try {
      f();
      std::printf("%s: no error\n", what);
    } catch (const Error& e) {
      std::printf("caught %s: %s\n", what, e.what());
    }
  };
  // The receiver stops at the header; the payload after it is drained by hand.
  if (group->rank() == 0) {
    b.send_activation(0, 0, ones({2, 3}));
    caught("ShapeError", [&] { b.recv_grad(0, 0, kCPU); });
    Tensor stale = zeros({3, 2});
    group->recv(stale, 1)->wait();
    b.finish();
  } else {
    require(b.recv_activation(1, 0, kCPU).shape() == Shape{2, 3}, "the activation's shape");
    b.send_grad(1, 0, ones({3, 2}));
    b.finish();
  }
  pp::ProcessBoundary b2(group);  // a fresh boundary: the next messages on the same channels
  group->barrier();
  if (group->rank() == 0) {
    b2.send_activation(0, 1, ones({2, 3}));
    group->barrier();  // rank 1 has read the header and stopped
  } else {
    caught("ValueError", [&] { b2.recv_activation(1, 0, kCPU); });
    Tensor stale = zeros({2, 3});
    group->recv(stale, 0)->wait();
    group->barrier();
  }
  group->barrier();
}

// Equal stages, so the idle time is the schedule's bubble (and the messages), not an imbalance.
// Each rank is one stage, so the allocator's counters of this process are this stage's own.
void run_pipeline_bench(const std::shared_ptr<ProcessGroup>& group, const Flags& f) {
  namespace pp = tandem::parallel::pipeline;
  const int P = group->size(), s = group->rank();
  const int M = int(f.num("--micro-batches", 4)), steps = int(f.num("--steps", 10));
  const int64_t width = f.num("--width", 512), layers = f.num("--layers", 4), rows = f.num("--rows", 0);
  const int64_t batch = rows > 0 ? rows * M : 256;  // --rows R: micro-batches of R rows
  std::string trace_path, kind = "1f1b";
  for (size_t i = 0; i + 1 < f.args.size(); ++i) {
    if (f.args[i] == "--trace") trace_path = f.args[i + 1];
    if (f.args[i] == "--schedule") kind = f.args[i + 1];
  }
  Generator gen(5);
  auto model = std::make_shared<nn::SequentialImpl>();
  for (int k = 0; k < layers * P; ++k) {
    model->push_back(std::make_shared<nn::Linear>(width, width, true, gen));
    model->push_back(std::make_shared<nn::ReLU>());
  }
  const pp::Stage stage = pp::stage_of_balance(*model, std::vector<int64_t>(size_t(P), 2 * layers), s, g_device);
  pp::ProcessPipeline pipe(stage, pp::schedule_by_name(kind, P, M),
                           [](const Tensor& out, const Tensor&) { return mean(out * out); }, group);
  nn::optim::SGD opt(stage.module->parameters(), 1e-3);
  size_t grad_bytes = 0;  // the gradients a step allocates (zero_grad set them to none)
  for (const Tensor& p : stage.module->parameters()) grad_bytes += size_t(p.numel()) * sizeof(float);
  parallel::Trace trace(g_device, s, "stage " + std::to_string(s));
  Tensor x = randn({batch, width}, kFloat32, kCPU, &gen), y = zeros({batch}, kFloat32);
  double ms = 0;
  size_t peak = 0;  // the most the step allocated above what was live before it
  for (int k = 0; k < steps; ++k) {
    pipe.set_trace(k > 0 ? &trace : nullptr);  // the first step warms up
    opt.zero_grad();
    const size_t live = allocated_bytes(g_device);
    reset_max_allocated_bytes(g_device);
    const auto t0 = std::chrono::steady_clock::now();
    pipe.step(x, y);
    opt.step();
    if (k == 0) continue;
    ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    peak = std::max(peak, max_allocated_bytes(g_device) - live);
  }
  std::printf("stage %d %s M %d batch %lld steps %d: %.2f ms per step, peak %.3f MB above live, "
              "of which gradients %.3f MB, in_flight %d\n",
              s, kind.c_str(), M, static_cast<long long>(batch), steps - 1, ms / std::max(1, steps - 1), peak / 1e6,
              grad_bytes / 1e6, pipe.max_in_flight());
  if (!trace_path.empty()) {
    group->store().set("bench-trace/" + std::to_string(s), trace.json());
    if (s == 0) {
      std::vector<std::string> parts;
      for (int r = 0; r < P; ++r) parts.push_back(group->store().get_string("bench-trace/" + std::to_string(r)));
      parallel::write_merged_trace(trace_path, parts);
    }
  }
  group->barrier();
}

// ---- pipeline stages x data-parallel replicas ---------------------------------------------

// grid [--stages P] [--replicas D] [--schedule gpipe|1f1b] [--micro-batches M] [--adam]
// [--steps S] [--batch B] [--kill-rank R --kill-step S]: LeNet as P stages ({7, 5} for 2) on
// a P x D grid (GridPipeline); every rank also trains the whole model in-process on the same
// global batches and prints "grid stage S replica D max_rel_err X loss_err Y checksum C" (C:
// the stage's parameters summed, to compare the replicas of a stage).
void run_grid(const std::shared_ptr<ProcessGroup>& world, const Flags& f) {
  namespace pp = tandem::parallel::pipeline;
  const int P = int(f.num("--stages", 2)), D = int(f.num("--replicas", 2));
  const int M = int(f.num("--micro-batches", 2)), steps = int(f.num("--steps", 3));
  const int64_t batch = f.num("--batch", 11);
  const int kill_rank = int(f.num("--kill-rank", -1)), kill_step = int(f.num("--kill-step", 1));
  std::string kind = "1f1b";
  for (size_t i = 0; i + 1 < f.args.size(); ++i) if (f.args[i] == "--schedule") kind = f.args[i + 1];
  pp::GridLayout grid(world, P, D);
  require(grid.rank_of(grid.stage(), grid.replica()) == world->rank(), "rank = stage * D + replica");
  auto make_model = pipeline_test_model;
  auto make_opt = [&](std::vector<Tensor> ps) { return pipeline_test_optimizer(f, std::move(ps)); };
  const std::vector<std::pair<Tensor, Tensor>> batches = pipeline_test_batches(steps, batch);
  auto one = make_model();  // the reference: one process, the whole model, the global batch
  std::vector<double> one_losses;
  {
    auto opt = make_opt(one->parameters());
    for (const auto& [x, y] : batches) {
      opt->zero_grad();
      Tensor loss = cross_entropy(one->forward(x), y);
      loss.backward();
      opt->step();
      one_losses.push_back(loss.item());
    }
  }
  std::vector<int64_t> balance;
  if (P == 2) balance = {7, 5};
  else for (int k = 0; k < P; ++k) balance.push_back(12 / P + (k < 12 % P ? 1 : 0));
  auto model = make_model();
  const pp::Stage stage = pp::stage_of_balance(*model, balance, grid.stage(), g_device);
  pp::GridPipeline pipe(stage, pp::schedule_by_name(kind, P, M),
                        [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); }, grid);
  auto opt = make_opt(stage.module->parameters());
  double loss_err = 0;
  for (int k = 0; k < steps; ++k) {
    if (world->rank() == kill_rank && k == kill_step) std::raise(SIGKILL);
    opt->zero_grad();
    std::vector<Tensor> per_micro_batch;
    const double loss = pipe.step(batches[size_t(k)].first, batches[size_t(k)].second, &per_micro_batch).item();
    require(per_micro_batch.size() == size_t(M), "one loss per micro-batch");
    loss_err = std::max(loss_err, std::abs(loss - one_losses[size_t(k)]) / one_losses[size_t(k)]);
    opt->step();
  }
  if (kill_rank >= 0) {  // the survivors go on until the failure reaches them
    for (int k = 0; k < 100000; ++k) pipe.step(batches[0].first, batches[0].second);
  }
  double err = 0, checksum = 0;
  for (size_t l = stage.begin; l < stage.end; ++l) {
    const auto a = (*model)[l]->parameters(), b = (*one)[l]->parameters();
    require(a.size() == b.size(), "same layers");
    for (size_t i = 0; i < a.size(); ++i) {
      err = std::max(err, rel_err(a[i], b[i]));
      for (double v : a[i].to(kCPU).to(kFloat64).to_vector<double>()) checksum += v;
    }
  }
  std::printf("grid stage %d replica %d max_rel_err %.3g loss_err %.3g checksum %.17g\n", grid.stage(),
              grid.replica(), err, loss_err, checksum);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: tandem_dist_worker MODE [flags]\n");
    return 2;
  }
  const std::string mode = argv[1];
  Flags f{std::vector<std::string>(argv + 2, argv + argc)};
  int rank = -1;
  try {
    const DistEnv env = read_dist_env();
    rank = env.rank;
    if (f.on("--nccl")) g_device = Device::cuda(env.local_rank);
    DistributedContext ctx = init_process_group(f.on("--nccl") ? "nccl" : "gloo", g_device);
    rank = ctx.env.rank;
    if (mode == "collectives") run_collectives(*ctx.group);
    else if (mode == "ddp") run_ddp(ctx.group, f);
    else if (mode == "no-sync") run_no_sync(ctx.group, f);
    else if (mode == "unused") run_unused(ctx.group, f);
    else if (mode == "armed") run_armed(ctx.group);
    else if (mode == "mismatch") run_mismatch(ctx.group);
    else if (mode == "kill") run_kill(ctx.group, f);
    else if (mode == "fingerprint") run_fingerprint(ctx.group);
    else if (mode == "silent") run_silent(ctx.group, f);
    else if (mode == "ring") run_ring(*ctx.group);
    else if (mode == "zero") run_zero(ctx.group, f);
    else if (mode == "zero-memory") run_zero_memory(ctx.group, f);
    else if (mode == "zero-kill") run_zero_kill(ctx.group, f);
    else if (mode == "fsdp") run_fsdp(ctx.group, f);
    else if (mode == "subgroups") run_subgroups(*ctx.group);
    else if (mode == "subgroup-fingerprint") run_subgroup_fingerprint(*ctx.group);
    else if (mode == "subgroup-kill") run_subgroup_kill(*ctx.group);
    else if (mode == "syncbn") run_syncbn(ctx.group, f);
    else if (mode == "syncbn-kill") run_syncbn_kill(ctx.group, f);
    else if (mode == "pipeline") run_pipeline(ctx.group, f);
    else if (mode == "pipeline-bench") run_pipeline_bench(ctx.group, f);
    else if (mode == "pipeline-messages") run_pipeline_messages(ctx.group);
    else if (mode == "grid") run_grid(ctx.group, f);
    else if (test::run_fsdp_full_mode(mode, ctx.group, f.args)) {}
    else if (mode.rfind("tensor-parallel", 0) == 0) tandem::test::run_tensor_parallel(mode, ctx.group, f.args);
    else throw std::runtime_error("unknown mode " + mode);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", rank, e.what());
    return 1;
  }
}
