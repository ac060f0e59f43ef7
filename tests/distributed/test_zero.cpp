// ZeroRedundancyOptimizer (parallel/sharded/zero_optimizer.h): a group of one in this process for
// the contract, then real processes over Gloo (the test worker, tests/distributed/dist_worker.cpp,
// started by tandem-run with 2 and 3 ranks) for the same numbers as DDP and as one process, the
// bytes per rank, and a rank killed inside a reduce-scatter or an all-gather. The test model has
// 2479 parameters: no rank count here divides it, so every shard layout has padding.
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "autograd/ops.h"
#include "catch.h"
#include "distributed/worker_run.h"
#include "data/data_test_util.h"
#include "helpers.h"
#include "nn/nn.h"
#include "parallel/distributed/launch.h"
#include "parallel/distributed/process_group.h"
#include "parallel/sharded/fsdp.h"
#include "parallel/sharded/fsdp_state_dict.h"
#include "parallel/sharded/zero_optimizer.h"

using namespace tandem;
using namespace tandem::parallel::distributed;
using tandem::parallel::sharded::optimizer_class;
using tandem::parallel::sharded::ZeroRedundancyOptimizer;
using tandem::parallel::sharded::ZeroRedundancyOptimizerOptions;

namespace {

#ifdef TANDEM_WITH_GLOO
// A one-rank job in this process: a store on a free port and a Gloo group of one.
struct OneRank {
  std::shared_ptr<TCPStore> store;
  std::shared_ptr<ProcessGroup> group;
  OneRank() {
    TCPStoreOptions o;
    o.is_master = true;
    o.rank = 0;
    o.timeout = std::chrono::seconds(20);
    o.job_id = "zero";
    store = std::make_shared<TCPStore>("127.0.0.1", 0, o);
    group = new_process_group("gloo", std::make_shared<PrefixStore>("pg", store), 0, 1);
  }
};

std::shared_ptr<nn::Module> small_net(uint64_t seed) {
  Generator gen(seed);
  auto seq = std::make_shared<nn::SequentialImpl>();
  seq->push_back(std::make_shared<nn::Linear>(5, 7, true, gen));
  seq->push_back(std::make_shared<nn::ReLU>());
  seq->push_back(std::make_shared<nn::Linear>(7, 3, true, gen));
  return seq;
}
#endif

}  // namespace

#ifdef TANDEM_WITH_GLOO
TEST_CASE("ZeroRedundancyOptimizer: bad options are errors that say what is wrong",
          "[dist][zero]") {
  OneRank one;
  auto net = small_net(1);
  auto adam = optimizer_class<nn::optim::Adam>(nn::optim::AdamOptions(1e-2));
  using tandem::test::contains;
  using tandem::test::error_message;
  ZeroRedundancyOptimizerOptions o;
  o.stage = 3;
  CHECK(contains(error_message<ValueError>(
                     [&] { ZeroRedundancyOptimizer(net->parameters(), adam, one.group, o); }),
                 "stage 3 is not one of 1"));
  CHECK(contains(error_message<ValueError>(
                     [&] { ZeroRedundancyOptimizer(net->parameters(), adam, one.group, o); }),
                 "FullyShardedDataParallel with FULL_SHARD"));
  o.stage = 2;
  o.gradients_reduced = true;
  CHECK(contains(error_message<ValueError>(
                     [&] { ZeroRedundancyOptimizer(net->parameters(), adam, one.group, o); }),
                 "gradients_reduced needs stage 1"));
  CHECK(contains(error_message<ValueError>([&] { ZeroRedundancyOptimizer({}, adam, one.group); }),
                 "no parameters"));
  ZeroRedundancyOptimizer zero(net->parameters(), adam, one.group);
  CHECK(contains(error_message<ValueError>([&] { zero.state_dict(); }), "consolidate_state_dict"));
  CHECK(contains(error_message<ValueError>([&] { zero.consolidate_state_dict(1); }), "to=1"));
}

TEST_CASE(
    "ZeroRedundancyOptimizer of one rank: stages 1 and 2 step like the plain optimizer, state "
    "included",
    "[dist][zero]") {
  OneRank one;
  for (int stage : {1, 2}) {
    INFO("stage " << stage);
    auto net = small_net(3), ref = small_net(3);
    ZeroRedundancyOptimizerOptions o;
    o.stage = stage;
    o.bucket_cap_mb = 100.0 / (1024 * 1024);  // 100-byte buckets: several, each padded on its own
    ZeroRedundancyOptimizer zero(net->parameters(),
                                 optimizer_class<nn::optim::AdamW>(nn::optim::AdamWOptions(1e-2)),
                                 one.group, o);
    CHECK(zero.num_buckets() > 1);
    nn::optim::AdamW plain(ref->parameters(), nn::optim::AdamWOptions(1e-2));
    Generator gen(9);
    for (int step = 0; step < 3; ++step) {
      Tensor x = randn({4, 5}, kFloat32, kCPU, &gen);
      Tensor y = from_vector<int64_t>({0, 2, 1, 2}, {4}, kCPU);
      zero.zero_grad();
      cross_entropy(net->forward(x), y).backward();
      if (stage == 2) {
        for (const Tensor& p : net->parameters())
          CHECK(!p.grad().defined());  // only the shard gradient is kept
      }
      zero.step();
      plain.zero_grad();
      cross_entropy(ref->forward(x), y).backward();
      plain.step();
    }
    auto a = net->parameters(), b = ref->parameters();
    for (size_t k = 0; k < a.size(); ++k) CHECK(a[k].to_vector<float>() == b[k].to_vector<float>());
    zero.consolidate_state_dict(0);
    const nn::StateDict mine = zero.state_dict(), theirs = plain.state_dict();
    REQUIRE(mine.keys() == theirs.keys());
    for (size_t k = 0; k < mine.size(); ++k) {
      INFO(mine.item(k).first);
      CHECK(mine.item(k).second.shape() == theirs.item(k).second.shape());
      CHECK(mine.item(k).second.to_vector<float>() == theirs.item(k).second.to_vector<float>());
    }
    // The consolidated state loads into a plain optimizer, and back into a fresh ZeRO one: a
    // further step of each then matches the original's.
    auto fresh = small_net(3);
    nn::optim::AdamW loaded(fresh->parameters(), nn::optim::AdamWOptions(1e-2));
    loaded.load_state_dict(mine);
    CHECK(loaded.step_count(0) == 3);
    auto again = small_net(4);
    for (size_t k = 0; k < a.size(); ++k) again->parameters()[k].detach().copy_(a[k]);
    ZeroRedundancyOptimizer resumed(
        again->parameters(), optimizer_class<nn::optim::AdamW>(nn::optim::AdamWOptions(1e-2)),
        one.group, o);
    resumed.load_state_dict(mine);
    Tensor x = randn({4, 5}, kFloat32, kCPU, &gen);
    Tensor y = from_vector<int64_t>({1, 0, 2, 2}, {4}, kCPU);
    for (auto* z : {&zero, &resumed}) {
      nn::Module& m = z == &zero ? *net : *again;
      z->zero_grad();
      cross_entropy(m.forward(x), y).backward();
      z->step();
    }
    auto c = again->parameters();
    for (size_t k = 0; k < a.size(); ++k) CHECK(c[k].to_vector<float>() == a[k].to_vector<float>());
    // A state that gives only some parameters of a bucket their moments is refused (the first
    // bucket holds parameters 3 and 2: the last layer's bias and weight, 96 bytes).
    REQUIRE(zero.bucket_numel(0) == 3 + 21);
    nn::StateDict cut;
    for (size_t k = 0; k < mine.size(); ++k) {
      if (mine.item(k).first.rfind("state.3.", 0) != 0)
        cut.insert(mine.item(k).first, mine.item(k).second);
    }
    CHECK(tandem::test::contains(
        tandem::test::error_message<ValueError>([&] { resumed.load_state_dict(cut); }),
        "of the same bucket"));
  }
}
#endif

#ifdef TANDEM_WITH_GLOO
TEST_CASE("FullyShardedDataParallel: bad options and reads of released parameters are errors",
          "[dist][zero][fsdp]") {
  using tandem::parallel::sharded::FullyShardedDataParallel;
  using tandem::parallel::sharded::FullyShardedDataParallelOptions;
  using tandem::parallel::sharded::ShardingStrategy;
  using tandem::test::contains;
  using tandem::test::error_message;
  OneRank one;
  FullyShardedDataParallelOptions o;
  o.sharding_strategy = ShardingStrategy::NO_SHARD;
  o.reshard_after_forward = true;
  CHECK(contains(
      error_message<ValueError>([&] { FullyShardedDataParallel(small_net(1), one.group, o); }),
      "NO_SHARD with reshard_after_forward"));
  // At rest a sharded parameter holds no bytes: a kernel on it names it instead of reading.
  auto net = small_net(1);
  FullyShardedDataParallel fsdp(net, one.group);
  CHECK(fsdp.reshard_after_forward());  // FULL_SHARD, the default
  const Tensor w = net->parameters()[0];
  CHECK(contains(error_message<ValueError>([&] { w.to_vector<float>(); }), "Tensor[7,5] float32 cpu"));
  CHECK(contains(error_message<ValueError>([&] { w.to_vector<float>(); }), "summon_full_params"));
  {
    auto full = fsdp.summon_full_params();
    CHECK(w.to_vector<float>().size() == 35);
  }
  CHECK(contains(error_message<ValueError>([&] { w.to_vector<float>(); }), "released"));
}

TEST_CASE("FullyShardedDataParallel FULL_SHARD of one rank trains to the plain optimizer's bits",
          "[dist][zero][fsdp]") {
  using tandem::parallel::sharded::BackwardPrefetch;
  using tandem::parallel::sharded::FullyShardedDataParallel;
  using tandem::parallel::sharded::FullyShardedDataParallelOptions;
  OneRank one;
  for (int prefetch = 0; prefetch < 3; ++prefetch) {
    INFO("backward prefetch " << prefetch << " (0 none, 1 pre, 2 post), forward prefetch too");
    auto net = small_net(6), ref = small_net(6);
    FullyShardedDataParallelOptions o;
    if (prefetch == 0) o.backward_prefetch.reset();
    if (prefetch == 2) o.backward_prefetch = BackwardPrefetch::BACKWARD_POST;
    o.forward_prefetch = prefetch > 0;
    FullyShardedDataParallel fsdp(net, one.group, o);
    nn::optim::AdamW opt(fsdp.parameters(), nn::optim::AdamWOptions(1e-2).weight_decay(0.1));
    nn::optim::AdamW plain(ref->parameters(), nn::optim::AdamWOptions(1e-2).weight_decay(0.1));
    Generator gen(8);
    for (int step = 0; step < 3; ++step) {
      Tensor x = randn({4, 5}, kFloat32, kCPU, &gen);
      Tensor y = from_vector<int64_t>({2, 0, 1, 1}, {4}, kCPU);
      opt.zero_grad();
      Tensor loss = cross_entropy(fsdp(x), y);
      // After forward only the last unit is whole (its backward comes next).
      CHECK(fsdp.memory().parameters == (21 + 3) * 4);
      loss.backward();
      opt.step();
      CHECK(fsdp.memory().parameters == 0);
      plain.zero_grad();
      cross_entropy(ref->forward(x), y).backward();
      plain.step();
    }
    auto full = fsdp.summon_full_params();
    auto a = net->parameters(), b = ref->parameters();
    for (size_t k = 0; k < a.size(); ++k) CHECK(a[k].to_vector<float>() == b[k].to_vector<float>());
  }
}

TEST_CASE("FullyShardedDataParallel of one rank steps like the plain optimizer, sharded at rest",
          "[dist][zero][fsdp]") {
  using tandem::parallel::sharded::FullyShardedDataParallel;
  OneRank one;
  auto net = small_net(2), ref = small_net(2);
  FullyShardedDataParallel fsdp(net, one.group);
  CHECK(fsdp.num_units() == 2);
  nn::optim::Adam opt(fsdp.parameters(), nn::optim::AdamOptions(1e-2));
  nn::optim::Adam plain(ref->parameters(), nn::optim::AdamOptions(1e-2));
  Generator gen(5);
  for (int step = 0; step < 3; ++step) {
    Tensor x = randn({4, 5}, kFloat32, kCPU, &gen);
    Tensor y = from_vector<int64_t>({0, 2, 1, 2}, {4}, kCPU);
    opt.zero_grad();
    cross_entropy(fsdp(x), y).backward();
    opt.step();
    plain.zero_grad();
    cross_entropy(ref->forward(x), y).backward();
    plain.step();
    CHECK(fsdp.memory().parameters == 0);
  }
  auto full = fsdp.summon_full_params();
  CHECK(fsdp.memory().parameters == (35 + 7 + 21 + 3) * 4);
  auto a = net->parameters(), b = ref->parameters();
  for (size_t k = 0; k < a.size(); ++k) CHECK(tandem::test::rel_error(a[k], b[k]) < 1e-6);
}

TEST_CASE("FSDP full state dicts of one rank: a plain optimizer's layout, and back, for both strategies",
          "[dist][zero][fsdp]") {
  namespace sh = tandem::parallel::sharded;
  for (sh::ShardingStrategy strategy : {sh::ShardingStrategy::SHARD_GRAD_OP, sh::ShardingStrategy::NO_SHARD}) {
    INFO(sh::sharding_strategy_name(strategy));
    OneRank one;
    auto net = small_net(3), ref = small_net(3);
    sh::FullyShardedDataParallel fsdp(net, one.group, {strategy});
    nn::optim::Adam opt(fsdp.parameters(), nn::optim::AdamOptions(1e-2));
    nn::optim::Adam plain(ref->parameters(), nn::optim::AdamOptions(1e-2));
    Generator gen(6);
    auto step = [&](sh::FullyShardedDataParallel& f, nn::optim::Optimizer& o, nn::Module& r, nn::optim::Optimizer& p) {
      Tensor x = randn({4, 5}, kFloat32, kCPU, &gen);
      Tensor y = from_vector<int64_t>({0, 2, 1, 2}, {4}, kCPU);
      o.zero_grad();
      cross_entropy(f(x), y).backward();
      o.step();
      p.zero_grad();
      cross_entropy(r.forward(x), y).backward();
      p.step();
    };
    for (int k = 0; k < 2; ++k) step(fsdp, opt, *ref, plain);
    // FSDP -> the plain layout: the module's names, the plain Adam's names in its order.
    const nn::StateDict weights = sh::full_state_dict(fsdp), state = sh::full_optim_state_dict(fsdp, opt);
    const nn::StateDict want_w = ref->state_dict(), want_s = plain.state_dict();
    REQUIRE(weights.keys() == want_w.keys());
    REQUIRE(state.keys() == want_s.keys());
    for (const auto& [name, t] : weights) CHECK(tandem::test::rel_error(t, want_w.at(name)) < 1e-6);
    for (const auto& [name, t] : state) CHECK(tandem::test::rel_error(t, want_s.at(name)) < 1e-5);
    // The plain layout -> a fresh FSDP model of other weights: it then steps as the plain one.
    auto net2 = small_net(4);
    sh::FullyShardedDataParallel fsdp2(net2, one.group, {strategy});
    nn::optim::Adam opt2(fsdp2.parameters(), nn::optim::AdamOptions(1e-2));
    sh::load_full_state_dict(fsdp2, want_w);
    opt2.load_state_dict(sh::shard_full_optim_state_dict(want_s, fsdp2));
    step(fsdp2, opt2, *ref, plain);
    {
      auto full = fsdp2.summon_full_params();
      auto a = net2->parameters(), b = ref->parameters();
      for (size_t k = 0; k < a.size(); ++k) CHECK(tandem::test::rel_error(a[k], b[k]) < 1e-6);
    }
    // Bad input names the entry: a unit's parameters with state only in part; a missing tensor.
    nn::StateDict partial = plain.state_dict();
    nn::StateDict cut;
    for (const auto& [name, t] : partial)
      if (name.rfind("state.1.", 0) != 0) cut.insert(name, t);
    CHECK(tandem::test::contains(
        tandem::test::error_message<ValueError>([&] { sh::shard_full_optim_state_dict(cut, fsdp2); }),
        "of the same unit"));
    nn::StateDict missing;
    for (const auto& [name, t] : want_w)
      if (name != "2.bias") missing.insert(name, t);
    CHECK(tandem::test::contains(
        tandem::test::error_message<ValueError>([&] { sh::load_full_state_dict(fsdp2, missing, "ckpt", "model."); }),
        "'model.2.bias'"));
  }
}
#endif

#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
namespace {

using Result = tandem::test::WorkerResult;
using tandem::test::sh;
std::string env(int timeout_s = 20) { return tandem::test::dist_timeout_env(timeout_s); }
Result run(const tandem::test::TempDir& dir, int n, const std::string& args, int timeout_s = 20) {
  return tandem::test::run_workers(dir, n, args, timeout_s);
}

using tandem::test::contains;
using tandem::test::TempDir;
using Clock = std::chrono::steady_clock;

std::set<std::string> param_hashes(const std::string& out) {
  std::set<std::string> hashes;
  std::regex re("params ([0-9a-f]{16})");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it)
    hashes.insert((*it)[1]);
  return hashes;
}

size_t count(const std::string& text, const std::string& part) {
  size_t k = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++k;
  return k;
}

double number_after(const std::string& out, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex(key + " ([-0-9.e+]+)"))) return -1;
  return std::stod(m[1]);
}

void check_training(const TempDir& dir, int stage) {
  for (int ranks : {2, 3}) {
    for (const char* optim : {"sgd", "adam", "adamw"}) {
      const std::string args = "zero --stage " + std::to_string(stage) + " --optim " + optim +
                               " --steps 4 --batch 10 --bucket-kb 4";
      Result r = run(dir, ranks, args);
      INFO(ranks << " ranks, " << args << "\n" << r.output);
      CHECK(r.code == 0);
      CHECK(count(r.output, "zero_vs_ddp") == size_t(ranks));
      CHECK(number_after(r.output, "zero_vs_ref") >= 0);
      CHECK(number_after(r.output, "zero_vs_ref") <= 1e-6);
      CHECK(number_after(r.output, "state_vs_ref") >= 0);
      CHECK(param_hashes(r.output).size() == 1);  // the all-gather leaves every rank the same bits
      CHECK(count(r.output, "buckets 3") == size_t(ranks));
    }
  }
}

// The "zero-memory WHEN world N stage S key value ..." lines of one run, per rank (the launcher
// prefixes "[rank R]"): the last line of each kind.
std::map<std::string, int64_t> memory_line(const std::string& out, const std::string& when,
                                           int rank, const std::string& tag = "zero-memory") {
  std::map<std::string, int64_t> v;
  std::regex re("\\[rank " + std::to_string(rank) + "\\] " + tag + " " + when + " (.*)");
  std::string last;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it)
    last = (*it)[1];
  std::istringstream in(last);
  std::string key;
  int64_t value;
  while (in >> key >> value) v[key] = value;
  return v;
}

// Two ranks started by hand (no launcher stops rank 0 early: it must end on its own) running
// `args`, in which rank 1 SIGKILLs itself: rank 0 exits 1 within its 5 s timeout (plus start
// and teardown), naming `collective` on rank 0 of 2 and rank 1 as gone.
void check_killed_pair(const TempDir& dir, const std::string& args, const std::string& collective) {
  const int port = tandem::parallel::distributed::free_port();
  const std::string common = env(5) + "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                             std::to_string(port) + " TANDEM_JOB_ID=z" + std::to_string(port) + " ";
  const std::string w = std::string(TANDEM_DIST_WORKER_PATH) + " " + args;
  Result r = sh(dir, "(" + common + "RANK=1 LOCAL_RANK=1 " + w + " & " + common + "RANK=0 LOCAL_RANK=0 " + w +
                         "; echo rank0 exit $?; wait)");
  INFO(args << "\n" << r.output);
  CHECK(contains(r.output, "rank0 exit 1"));
  CHECK(r.seconds < 5 + 10);
  CHECK(std::regex_search(r.output, std::regex(collective + " #[0-9]+ .* on rank 0 of 2")));
  CHECK(contains(r.output, "rank 1 is gone"));
}

}  // namespace

TEST_CASE(
    "ZeRO-1 over Gloo trains to DDP's and one process's parameters (SGD+momentum, Adam, AdamW)",
    "[dist][zero]") {
  TempDir dir;
  check_training(dir, 1);
  // Beside DDP, the gradients already averaged (PyTorch's usage).
  for (int ranks : {2, 3}) {
    Result r = run(dir, ranks, "zero --stage 1 --optim adam --ddp --steps 4 --batch 11");
    INFO(r.output);
    CHECK(r.code == 0);
    CHECK(number_after(r.output, "zero_vs_ref") >= 0);
    CHECK(param_hashes(r.output).size() == 1);
  }
}

TEST_CASE(
    "ZeRO-2 over Gloo trains to DDP's and one process's parameters (SGD+momentum, Adam, AdamW)",
    "[dist][zero]") {
  TempDir dir;
  check_training(dir, 2);
}

TEST_CASE(
    "ZeRO: optimizer state per rank falls as 1/N (stage 1), gradients too (stage 2), within the "
    "padding",
    "[dist][zero]") {
  TempDir dir;
  // Buckets of 4 KiB: 135, 2304 and 40 elements, each padded to a multiple of N.
  const std::vector<int64_t> buckets = {135, 2304, 40};
  const int64_t numel = 2479, f32 = 4;
  for (int stage : {1, 2}) {
    for (int n : {1, 2, 3}) {
      Result r = run(
          dir, n, "zero-memory --stage " + std::to_string(stage) + " --optim adam --bucket-kb 4");
      INFO("stage " << stage << ", " << n << " ranks\n" << r.output);
      REQUIRE(r.code == 0);
      CHECK(contains(r.output, "buckets 3: 135 2304 40"));
      int64_t shard = 0;
      for (int64_t b : buckets) shard += (b + n - 1) / n;
      CHECK(shard * n - numel < 3 * n);  // the padding: under N elements per bucket
      for (int rank = 0; rank < n; ++rank) {
        auto back = memory_line(r.output, "after-backward", rank),
             step = memory_line(r.output, "after-step", rank);
        REQUIRE(!back.empty());
        REQUIRE(!step.empty());
        CHECK(step["world"] == n);
        CHECK(step["numel"] == numel);
        CHECK(step["shard"] == shard);
        CHECK(step["params"] == numel * f32);
        CHECK(step["shard_params"] == shard * f32);
        // Adam: two moments of the shard, plus a 4-byte step count per bucket shard.
        CHECK(step["state"] == 2 * shard * f32 + 3 * 4);
        CHECK(step["ddp_state"] == 2 * numel * f32 + 3 * 4);
        // Stage 1 keeps the full gradient; stage 2 only the shard's, from backward on.
        CHECK(back["grads"] == (stage == 1 ? numel * f32 : shard * f32));
        CHECK(back["ddp_grads"] == numel * f32);
      }
    }
  }
}

TEST_CASE("ZeRO: a rank killed inside a reduce-scatter or an all-gather ends the others, naming it",
          "[dist][zero][failure]") {
  TempDir dir;
  struct Case {
    int stage;
    const char* at;
    const char* collective;
  };
  for (const Case& c : {Case{1, "reduce", "reduce_scatter"}, Case{1, "gather", "allgather"},
                        Case{2, "reduce", "reduce_scatter"}, Case{2, "gather", "allgather"}}) {
    check_killed_pair(dir, "zero-kill --stage " + std::to_string(c.stage) + " --kill-at " + c.at,
                      c.collective);
  }
}
TEST_CASE(
    "FSDP over Gloo (SHARD_GRAD_OP, NO_SHARD) trains to DDP's and one process's parameters, "
    "sharded at rest",
    "[dist][zero][fsdp]") {
  TempDir dir;
  const std::vector<int64_t> units = {40, 2320, 119};  // the conv and the two linears
  struct Case {
    int ranks;
    std::string args;
  };
  for (const Case& c : {Case{2, "--optim sgd"}, Case{3, "--optim sgd"}, Case{2, "--optim adam"},
                        Case{3, "--optim adam"}, Case{2, "--optim adamw"}, Case{3, "--optim adamw"},
                        Case{2, "--optim adam --no-shard"}, Case{3, "--optim adam --no-shard"}}) {
    Result r = run(dir, c.ranks, "fsdp " + c.args + " --steps 4 --batch 10");
    INFO(c.ranks << " ranks, " << c.args << "\n" << r.output);
    CHECK(r.code == 0);
    CHECK(contains(r.output, "units 3: 40 2320 119"));
    CHECK(number_after(r.output, "fsdp_vs_ref") >= 0);
    CHECK(number_after(r.output, "fsdp_vs_ref") <= 1e-6);
    CHECK(count(r.output, "fsdp_vs_ddp") == size_t(c.ranks));
    CHECK(param_hashes(r.output).size() == 1);
    const bool sharded = !contains(c.args, "--no-shard");
    const int n = sharded ? c.ranks : 1;
    int64_t shard = 0;
    for (int64_t u : units) shard += (u + n - 1) / n;
    for (int rank = 0; rank < c.ranks; ++rank) {
      auto rest = memory_line(r.output, "rest", rank, "fsdp-memory");
      auto back = memory_line(r.output, "after-backward", rank, "fsdp-memory");
      REQUIRE(!rest.empty());
      CHECK(rest["params"] == 0);  // sharded: released; NO_SHARD: counted in the flat parameters
      CHECK(rest["flat"] == shard * 4);
      CHECK(back["grads"] == shard * 4);  // only the flat parameters' gradients
    }
  }
}

// The fsdp-full modes (tests/distributed/worker_fsdp_full.cpp): six Linear units of 416, 1584,
// 1960, 984, 1000 and 287 parameters (eleven, 13071 parameters, in the memory mode).
int64_t padded_sum(const std::vector<int64_t>& units, int n) {
  int64_t total = 0;
  for (int64_t u : units) total += (u + n - 1) / n;
  return total;
}

TEST_CASE(
    "FSDP FULL_SHARD over Gloo trains to DDP's and one process's parameters (SGD+momentum, Adam, "
    "AdamW), with and without accumulation over two micro-batches",
    "[dist][zero][fsdp]") {
  TempDir dir;
  const std::vector<int64_t> units = {416, 1584, 1960, 984, 1000, 287};
  std::vector<std::pair<int, std::string>> cases;
  for (int ranks : {2, 3}) {
    for (const char* optim : {"sgd", "adam", "adamw"}) {
      for (const char* accum : {"", " --accum"}) cases.emplace_back(ranks, std::string("--optim ") + optim + accum);
    }
  }
  cases.emplace_back(3, "--optim adam --prefetch post --forward-prefetch");
  cases.emplace_back(2, "--optim adamw --prefetch none --accum");
  for (const auto& [ranks, args] : cases) {
    Result r = run(dir, ranks, "fsdp-full " + args + " --steps 4 --batch 12");
    INFO(ranks << " ranks, " << args << "\n" << r.output);
    CHECK(r.code == 0);
    CHECK(contains(r.output, "units 6: 416 1584 1960 984 1000 287"));
    CHECK(number_after(r.output, "full_vs_ref") >= 0);
    CHECK(number_after(r.output, "full_vs_ref") <= 1e-6);
    CHECK(count(r.output, "full_vs_ddp") == size_t(ranks));
    CHECK(param_hashes(r.output).size() == 1);
    for (int rank = 0; rank < ranks; ++rank) {
      auto rest = memory_line(r.output, "rest", rank, "fsdp-full-memory");
      REQUIRE(!rest.empty());
      CHECK(rest["params"] == 0);  // at rest: only the shards, Ψ/N plus the padding
      CHECK(rest["flat"] == padded_sum(units, ranks) * 8);  // float64
      CHECK(rest["grads"] == padded_sum(units, ranks) * 8);
    }
  }
}

TEST_CASE(
    "FSDP FULL_SHARD: the allocator's peak falls below SHARD_GRAD_OP's by the parameters less "
    "about two units",
    "[dist][zero][fsdp]") {
  TempDir dir;
  const std::vector<int64_t> units = {416, 1584, 1960, 984, 1000, 1312, 1584, 1960, 984, 1000, 287};
  for (int n : {2, 3}) {
    std::map<std::string, Result> runs;
    for (const char* s : {"full", "grad-op"}) runs[s] = run(dir, n, std::string("fsdp-full-memory --strategy ") + s);
    const int64_t whole = 4 * n * padded_sum(units, n), unit = 4 * n * ((1960 + n - 1) / n);
    for (int rank = 0; rank < n; ++rank) {
      auto full = memory_line(runs["full"].output, "strategy full", rank, "fsdp-full-peak");
      auto op = memory_line(runs["grad-op"].output, "strategy grad-op", rank, "fsdp-full-peak");
      INFO(n << " ranks, rank " << rank << "\n" << runs["full"].output << runs["grad-op"].output);
      REQUIRE(runs["full"].code == 0);
      REQUIRE(runs["grad-op"].code == 0);
      REQUIRE(!full.empty());
      REQUIRE(!op.empty());
      // Each peak is taken above the bytes the rank held before that step's forward (which vary
      // by a few hundred bytes with when Gloo's thread drops a finished collective's buffers).
      // Forward: SHARD_GRAD_OP ends it with every unit whole, FULL_SHARD with one unit at most.
      const int64_t forward_gap = op["forward_above_rest"] - full["forward_above_rest"];
      CHECK(forward_gap >= whole - 2 * unit);
      CHECK(forward_gap <= whole);
      // Forward and backward: FULL_SHARD holds two units (the current one, the prefetched one)
      // where SHARD_GRAD_OP holds them all; the gradients' buffers are the same in both.
      CHECK(op["above_rest"] - full["above_rest"] >= unit);
    }
  }
}

TEST_CASE("FSDP FULL_SHARD: a rank killed before an all-gather of forward or backward ends the other, naming it",
          "[dist][zero][fsdp][failure]") {
  TempDir dir;
  for (const char* at : {"forward", "backward"}) {
    check_killed_pair(dir, std::string("fsdp-full-kill --kill-at ") + at, "allgather");
  }
}

TEST_CASE("FSDP FULL_SHARD: the timeline has each unit's gather, compute, free and reduce-scatter on both ranks",
          "[dist][zero][fsdp]") {
  TempDir dir;
  const std::string path = dir.file("fsdp.json");
  Result r = run(dir, 2, "fsdp-full --optim sgd --steps 2 --forward-prefetch --trace " + path);
  INFO(r.output);
  REQUIRE(r.code == 0);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  CHECK(contains(json, "\"rank 0\""));
  CHECK(contains(json, "\"rank 1\""));
  // One traced step: per rank, a forward gather of each unit and a pre-backward gather of each but
  // the last (kept whole), a forward, a backward and a reduce-scatter of each, a free of each
  // after its forward but the last and one after its backward.
  for (int u = 0; u < 6; ++u) {
    const std::string n = " " + std::to_string(u) + "\"";
    INFO("unit " << u);
    CHECK(count(json, "\"gather" + n) == size_t(2 * (u < 5 ? 2 : 1)));
    CHECK(count(json, "\"forward" + n) == 2);
    CHECK(count(json, "\"backward" + n) == 2);
    CHECK(count(json, "\"reduce-scatter" + n) == 2);
    CHECK(count(json, "\"free" + n) == size_t(2 * (u < 5 ? 2 : 1)));
  }
}
#endif
