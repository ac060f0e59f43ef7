// FullyShardedDataParallel with FULL_SHARD across real processes (the modes below, started by
// tandem-run from tests/distributed/test_zero.cpp). The model is a stack of Linear layers of
// uneven sizes, one FSDP unit each, so that no rank count divides a unit:
//
//   fsdp-full [--optim sgd|adam|adamw] [--accum] [--prefetch pre|post|none] [--forward-prefetch]
//             [--strategy full|grad-op] [--steps S] [--batch B] [--scale K] [--trace FILE]
//       trains S steps vs DDP with the plain optimizer in the same ranks ("full_vs_ddp X") and,
//       on rank 0, one process on the global batch ("full_vs_ref X"); --accum runs each step
//       as two micro-batches, backward twice before the optimizer step; "params HASH" per rank;
//       "fsdp-full-memory rest ..." the bytes held at rest. --scale K multiplies the hidden
//       widths; --trace FILE: rank 0 writes the merged timeline of the steps after the first.
//   fsdp-full-memory [--strategy full|grad-op] [--scale K] [--depth D]
//       after a warm-up step, the allocator's peak during one forward, and during forward and
//       backward, above what the rank held before ("fsdp-full-peak ... forward_above_rest F
//       above_rest P").
//   fsdp-full-kill --kill-at forward|backward
//       rank 1 SIGKILLs itself at step 2 before its forward (the others are then in the first
//       unit's all-gather) or after it (the others are in the pre-backward all-gather).
#include "distributed/worker_fsdp_full.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <functional>
#include <stdexcept>

#include "autograd/ops.h"
#include "core/allocator.h"
#include "distributed/dist_test_model.h"
#include "nn/nn.h"
#include "parallel/distributed/ddp.h"
#include "parallel/sharded/fsdp.h"
#include "parallel/trace.h"

namespace tandem::test {

namespace {

using parallel::distributed::ProcessGroup;
using parallel::sharded::BackwardPrefetch;
using parallel::sharded::FullyShardedDataParallel;
using parallel::sharded::FullyShardedDataParallelOptions;
using parallel::sharded::ShardingStrategy;

struct Args {
  std::vector<std::string> list;
  std::string get(const std::string& name, const std::string& def) const {
    for (size_t i = 0; i + 1 < list.size(); ++i) {
      if (list[i] == name) return list[i + 1];
    }
    return def;
  }
  long num(const std::string& name, long def) const {
    const std::string v = get(name, "");
    return v.empty() ? def : std::stol(v);
  }
  bool on(const std::string& name) const {
    for (const std::string& a : list) {
      if (a == name) return true;
    }
    return false;
  }
};

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

constexpr int64_t kIn = 12, kClasses = 7;

// Linear 12 -> 32K -> 48K -> 40K -> 24K -> 40K -> 7, ReLU between: six units of uneven sizes
// (416, 1584, 1960, 984, 1000, 287 parameters for K = 1), in `dtype`. Depth D repeats the hidden
// widths D times (D = 2: eleven units, 13071 parameters).
std::shared_ptr<nn::Module> stack_net(uint64_t seed, int64_t k, DType dtype = kFloat32,
                                      int depth = 1) {
  std::vector<int64_t> widths = {kIn};
  for (int d = 0; d < depth; ++d) {
    for (int64_t h : {32, 48, 40, 24, 40}) widths.push_back(h * k);
  }
  widths.push_back(kClasses);
  Generator gen(seed);
  auto seq = std::make_shared<nn::SequentialImpl>();
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    if (i > 0) seq->push_back(std::make_shared<nn::ReLU>());
    seq->push_back(std::make_shared<nn::Linear>(widths[i], widths[i + 1], true, gen));
  }
  // nn has no Module::to(DType): each parameter's TensorImpl takes a converted copy's storage.
  for (const Tensor& p : seq->parameters()) {
    const Tensor c = p.detach().to(dtype);
    TensorImpl* impl = p.impl();
    impl->storage = c.storage();
    impl->offset = c.offset();
    impl->strides = c.strides();
    impl->dtype = dtype;
  }
  return seq;
}

// The same global batches on every rank.
std::vector<std::pair<Tensor, Tensor>> stack_batches(int steps, int64_t batch, Device device,
                                                     DType dtype = kFloat32) {
  Generator gen(4321);
  std::vector<std::pair<Tensor, Tensor>> out;
  for (int s = 0; s < steps; ++s) {
    Tensor x = randn({batch, kIn}, kFloat32, kCPU, &gen);
    std::vector<int64_t> y(static_cast<size_t>(batch));
    for (auto& l : y) l = static_cast<int64_t>(gen.next_u64() % kClasses);
    out.emplace_back(x.to(device, dtype), from_vector<int64_t>(y, {batch}, device));
  }
  return out;
}

std::unique_ptr<nn::optim::Optimizer> make_optimizer(const std::string& name,
                                                     std::vector<Tensor> ps) {
  using namespace nn::optim;
  if (name == "sgd") return std::make_unique<SGD>(std::move(ps), SGDOptions(0.05).momentum(0.9));
  if (name == "adam") return std::make_unique<Adam>(std::move(ps), AdamOptions(5e-3));
  if (name == "adamw")
    return std::make_unique<AdamW>(std::move(ps), AdamWOptions(5e-3).weight_decay(0.05));
  throw std::runtime_error("unknown --optim " + name);
}

FullyShardedDataParallelOptions fsdp_options(const Args& a) {
  FullyShardedDataParallelOptions o;
  const std::string strategy = a.get("--strategy", "full");
  check(strategy == "full" || strategy == "grad-op", "--strategy full|grad-op, not " + strategy);
  o.sharding_strategy =
      strategy == "full" ? ShardingStrategy::FULL_SHARD : ShardingStrategy::SHARD_GRAD_OP;
  const std::string prefetch = a.get("--prefetch", "pre");
  if (prefetch == "none")
    o.backward_prefetch.reset();
  else if (prefetch == "post")
    o.backward_prefetch = BackwardPrefetch::BACKWARD_POST;
  else
    check(prefetch == "pre", "--prefetch pre|post|none, not " + prefetch);
  o.forward_prefetch = a.on("--forward-prefetch");
  return o;
}

// Rows [start, end) of a global batch of B for rank r of w: sizes differ by at most one.
std::pair<int64_t, int64_t> rows_of(int64_t B, int r, int w) {
  const int64_t base = B / w, extra = B % w, start = r * base + std::min<int64_t>(r, extra);
  return {start, start + base + (r < extra ? 1 : 0)};
}

// The loss of `rows` of the global batch (B rows, w ranks), scaled so that averaging the ranks'
// gradients, each summed over its micro-batches, gives the gradient of the global batch's mean.
Tensor part_loss(const std::function<Tensor(const Tensor&)>& model, const Tensor& x,
                 const Tensor& y, std::pair<int64_t, int64_t> rows, int64_t B, int w) {
  const auto [s, e] = rows;
  return mul(cross_entropy(model(x.slice(0, s, e)), y.slice(0, s, e)),
             double(w) * double(e - s) / double(B));
}

// max over tensors of max|a - b| / max|b|.
double worst_rel(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  check(a.size() == b.size(), "as many tensors on both sides");
  double worst = 0;
  for (size_t k = 0; k < a.size(); ++k) {
    const std::vector<double> got = a[k].to_vector<double>(), want = b[k].to_vector<double>();
    double diff = 0, top = 1e-30;
    for (size_t i = 0; i < want.size(); ++i) {
      diff = std::max(diff, std::abs(got.at(i) - want[i]));
      top = std::max(top, std::abs(want[i]));
    }
    worst = std::max(worst, diff / top);
  }
  return worst;
}

void print_rest(const FullyShardedDataParallel& fsdp) {
  const auto m = fsdp.memory();
  std::printf(
      "fsdp-full-memory rest world %d numel %lld shard %lld params %lld flat %lld grads %lld\n",
      m.world_size, (long long)m.numel, (long long)m.shard_numel, (long long)m.parameters,
      (long long)m.flat_parameters, (long long)m.gradients);
}

void print_units(const FullyShardedDataParallel& fsdp) {
  std::printf("units %zu:", fsdp.num_units());
  for (size_t u = 0; u < fsdp.num_units(); ++u) std::printf(" %lld", (long long)fsdp.unit_numel(u));
  std::printf("\n");
}

void write_trace(ProcessGroup& group, const parallel::Trace& trace, const std::string& path) {
  const int r = group.rank();
  group.store().set("fsdp-trace/" + std::to_string(r), trace.json());
  if (r == 0) {
    std::vector<std::string> parts;
    for (int k = 0; k < group.size(); ++k)
      parts.push_back(group.store().get_string("fsdp-trace/" + std::to_string(k)));
    parallel::write_merged_trace(path, parts);
  }
  group.barrier();
}

void run_train(const std::shared_ptr<ProcessGroup>& group, const Args& a) {
  const int steps = int(a.num("--steps", 4)), r = group->rank(), w = group->size();
  const int64_t B = a.num("--batch", 12), k = a.num("--scale", 1);
  const std::string optim = a.get("--optim", "adam"), trace_path = a.get("--trace", "");
  const bool accum = a.on("--accum");
  const Device device = group->device();
  // Float64: Adam turns the last bits of a gradient that nearly cancels into a whole step's
  // difference, and the three trainings sum in different orders (float32 gave up to 1e-5).
  auto batches = stack_batches(steps, B, device, kFloat64);
  auto net = stack_net(7 + uint64_t(r), k, kFloat64);  // rank 0's parameters are broadcast
  net->to(device);
  FullyShardedDataParallel fsdp(net, group, fsdp_options(a));
  check(fsdp.reshard_after_forward() == (a.get("--strategy", "full") == "full"),
        "FULL_SHARD reshards after forward");
  auto opt = make_optimizer(optim, fsdp.parameters());
  parallel::distributed::DistributedDataParallel ddp(stack_net(7 + uint64_t(r), k, kFloat64),
                                                     group);
  auto ddp_opt = make_optimizer(optim, ddp.parameters());
  parallel::Trace trace(device, r, "rank " + std::to_string(r));
  print_units(fsdp);
  print_rest(fsdp);
  for (int step = 0; step < steps; ++step) {
    const auto& [x, y] = batches[size_t(step)];
    const auto rows = rows_of(B, r, w);
    fsdp.set_trace(!trace_path.empty() && step > 0 ? &trace : nullptr);  // the first step warms up
    opt->zero_grad();
    auto fsdp_fn = [&](const Tensor& in) { return fsdp(in); };
    if (accum) {  // two micro-batches: this rank's rows cut in two, gradients summed by backward
      const int64_t mid = rows.first + (rows.second - rows.first) / 2;
      part_loss(fsdp_fn, x, y, {rows.first, mid}, B, w).backward();
      part_loss(fsdp_fn, x, y, {mid, rows.second}, B, w).backward();
    } else {
      part_loss(fsdp_fn, x, y, rows, B, w).backward();
    }
    {
      auto span = parallel::Trace::scoped(!trace_path.empty() && step > 0 ? &trace : nullptr,
                                          device, "optimizer");
      opt->step();
    }
    ddp_opt->zero_grad();
    part_loss([&](const Tensor& in) { return ddp(in); }, x, y, rows, B, w).backward();
    ddp_opt->step();
    const auto rest = fsdp.memory();
    check(rest.parameters == 0, "no module parameter holds bytes at rest");
  }
  print_rest(fsdp);
  if (!trace_path.empty()) write_trace(*group, trace, trace_path);
  auto full = fsdp.summon_full_params();
  const double vs_ddp = worst_rel(net->parameters(), ddp.parameters());
  std::printf("full_vs_ddp %.3g\n", vs_ddp);
  std::printf("params %016llx\n", static_cast<unsigned long long>(dist_params_hash(*net)));
  check(vs_ddp <= 1e-6, "FULL_SHARD parameters equal DDP's to 1e-6");
  if (r == 0) {
    auto ref = stack_net(7, k, kFloat64);
    ref->to(device);
    auto ref_opt = make_optimizer(optim, ref->parameters());
    for (const auto& [x, y] : batches) {
      ref_opt->zero_grad();
      cross_entropy(ref->forward(x), y).backward();
      ref_opt->step();
    }
    const double vs_ref = worst_rel(net->parameters(), ref->parameters());
    std::printf("full_vs_ref %.3g\n", vs_ref);
    check(vs_ref <= 1e-6, "FULL_SHARD parameters equal one process's to 1e-6");
  }
}

void run_memory(const std::shared_ptr<ProcessGroup>& group, const Args& a) {
  const int r = group->rank(), w = group->size();
  const int64_t B = 12, k = a.num("--scale", 1);
  const Device device = group->device();
  auto batches = stack_batches(2, B, device);
  auto net = stack_net(7, k, kFloat32, int(a.num("--depth", 2)));
  net->to(device);
  FullyShardedDataParallel fsdp(net, group, fsdp_options(a));
  auto opt = make_optimizer("adam", fsdp.parameters());
  for (const auto& [x, y] : batches) {  // the first step warms up (optimizer state, Gloo's buffers)
    opt->zero_grad();
    const size_t rest = allocated_bytes(device);
    reset_max_allocated_bytes(device);
    Tensor loss =
        part_loss([&](const Tensor& in) { return fsdp(in); }, x, y, rows_of(B, r, w), B, w);
    const size_t forward_peak = max_allocated_bytes(device);
    loss.backward();
    const size_t peak = max_allocated_bytes(device);
    opt->step();
    std::printf(
        "fsdp-full-peak strategy %s world %d rest %lld forward_above_rest %lld above_rest %lld\n",
        a.get("--strategy", "full").c_str(), w, (long long)rest, (long long)(forward_peak - rest),
        (long long)(peak - rest));
  }
  print_units(fsdp);
  print_rest(fsdp);
}

void run_kill(const std::shared_ptr<ProcessGroup>& group, const Args& a) {
  const std::string at = a.get("--kill-at", "backward");
  check(at == "forward" || at == "backward", "--kill-at forward|backward, not " + at);
  const int r = group->rank(), w = group->size();
  const Device device = group->device();
  auto batches = stack_batches(4, 12, device);
  auto net = stack_net(7, 1);
  net->to(device);
  FullyShardedDataParallel fsdp(net, group, fsdp_options(a));
  auto opt = make_optimizer("adam", fsdp.parameters());
  for (int step = 0; step < 100000; ++step) {
    const bool die = r == 1 && step == 2;
    if (die && at == "forward") std::raise(SIGKILL);
    const auto& [x, y] = batches[size_t(step % 4)];
    opt->zero_grad();
    Tensor loss =
        part_loss([&](const Tensor& in) { return fsdp(in); }, x, y, rows_of(12, r, w), 12, w);
    if (die) std::raise(SIGKILL);
    loss.backward();
    opt->step();
  }
}

}  // namespace

bool run_fsdp_full_mode(const std::string& mode, const std::shared_ptr<ProcessGroup>& group,
                        const std::vector<std::string>& args) {
  const Args a{args};
  if (mode == "fsdp-full")
    run_train(group, a);
  else if (mode == "fsdp-full-memory")
    run_memory(group, a);
  else if (mode == "fsdp-full-kill")
    run_kill(group, a);
  else
    return false;
  return true;
}

}  // namespace tandem::test
