// The from-scratch path and the concise ones compute the same numbers: ScratchTrainer,
// DataParallel and DistributedDataParallel (two CPU processes over Gloo) reach the same
// parameters after k SGD steps from the same start on the same global batches.
//
// Tolerances, and why (measured values in docs/05-parallel.md, "The same numbers"):
// - scratch with the ring vs the naive allreduce, and scratch vs DDP on 2 ranks: bitwise. The
//   arithmetic is the same: each shard's mean loss scaled by its share of rows (DDP scales by
//   world_size times that and divides the summed gradient by world_size = 2, both exact in
//   binary), one sum of two gradients (a + b = b + a), the same SGD kernel.
// - DataParallel vs scratch, and either vs one device: <= 1e-6 relative. DataParallel takes
//   the mean over the gathered global batch (1/B per row) where scratch takes 1/b_r per row
//   times b_r/B, and one device sums the rows of a batch in one GEMM where the others add two
//   shards' sums: the same math, rounded in another order.
#include <cstdio>
#include <cstring>

#include "distributed/dist_test_model.h"
#include "parallel_test_util.h"

#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "data/data_test_util.h"
#endif

using namespace tandem;
using namespace tandem::parallel;

namespace {

// The test worker's model and batches (tests/distributed/dist_test_model.h): the DDP run there starts
// from make_net(7) and trains on these batches.
std::shared_ptr<nn::Module> worker_net() { return test::dist_test_net(7, /*bn=*/false); }

std::vector<std::pair<Tensor, Tensor>> worker_batches(int steps, int64_t batch) {
  return test::dist_test_batches(steps, batch);
}

// The worker's "params HASH": FNV-1a over the float32 bits of every parameter.
uint64_t params_hash(const nn::Module& m) { return test::dist_params_hash(m); }

// max over parameters of max |a - b| / max(1, max |b|) (the worker's max_rel_err).
double max_diff(const nn::Module& a, const nn::Module& b) { return test::max_param_error(a, b); }

constexpr int kSteps = 4;
constexpr double kLr = 0.1, kMomentum = 0.9;

std::shared_ptr<nn::Module> train_scratch(int64_t batch, const std::string& comm) {
  auto net = worker_net();
  ScratchTrainer trainer(net, cpu_devices(2), comm, test::sgd_factory(kLr, kMomentum));
  for (const auto& [x, y] : worker_batches(kSteps, batch)) trainer.train_batch(x, y);
  return net;  // replica 0
}

std::shared_ptr<nn::Module> train_data_parallel(int64_t batch) {
  auto net = worker_net();
  DataParallel dp(net, cpu_devices(2));
  nn::optim::SGD opt(dp.parameters(), kLr, kMomentum);
  for (const auto& [x, y] : worker_batches(kSteps, batch)) {
    opt.zero_grad();
    cross_entropy(dp(x), y.to(Device::cpu(0))).backward();
    opt.step();
  }
  return net;
}

std::shared_ptr<nn::Module> train_one_device(int64_t batch) {
  auto net = worker_net();
  test::train_reference(*net, worker_batches(kSteps, batch), kLr, kMomentum);
  return net;
}

}  // namespace

TEST_CASE("scratch, DataParallel and one device reach the same parameters", "[parallel][same-numbers]") {
  for (int64_t batch : {10, 11}) {  // even shards (5 + 5) and uneven ones (6 + 5)
    auto ring = train_scratch(batch, "ring"), naive = train_scratch(batch, "naive");
    auto dp = train_data_parallel(batch), one = train_one_device(batch);
    const double d_ring = max_diff(*ring, *naive), d_dp = max_diff(*dp, *ring), d_one = max_diff(*one, *ring);
    std::printf("same numbers, batch %lld, %d steps: scratch ring vs naive %.3g, DataParallel vs scratch %.3g, "
                "one device vs scratch %.3g\n",
                static_cast<long long>(batch), kSteps, d_ring, d_dp, d_one);
    CHECK(params_hash(*ring) == params_hash(*naive));  // bitwise
    CHECK(d_ring == 0.0);
    CHECK(d_dp <= 1e-6);
    CHECK(d_one <= 1e-6);
    CHECK(max_diff(*ring, *worker_net()) > 1e-3);  // the steps moved the parameters: not a vacuous match
  }
}

#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
TEST_CASE("scratch on 2 virtual devices and DDP on 2 Gloo processes reach bit-identical parameters",
          "[parallel][same-numbers][dist]") {
  test::TempDir dir;
  for (int64_t batch : {10, 11}) {
    const std::string out = dir.file("ddp" + std::to_string(batch) + ".txt");
    const std::string cmd = std::string("TANDEM_DIST_TIMEOUT=20 ") + TANDEM_RUN_PATH +
                            " --standalone --grace-seconds 1 --nproc-per-node 2 " + TANDEM_DIST_WORKER_PATH +
                            " ddp --steps " + std::to_string(kSteps) + " --batch " + std::to_string(batch) + " > " +
                            out + " 2>&1";
    const int status = std::system(cmd.c_str());
    std::ifstream f(out);
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string text = ss.str();
    INFO(text);
    REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
    std::set<std::string> hashes;
    const std::regex re("params ([0-9a-f]{16})");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it)
      hashes.insert((*it)[1]);
    REQUIRE(hashes.size() == 1);  // both ranks hold the same parameters
    char scratch[17];
    std::snprintf(scratch, sizeof scratch, "%016llx",
                  static_cast<unsigned long long>(params_hash(*train_scratch(batch, "ring"))));
    std::smatch err;
    std::regex_search(text, err, std::regex("max_rel_err ([0-9.e+-]+)"));
    std::printf("same numbers, batch %lld: DDP params %s, scratch params %s, DDP vs one process %s\n",
                static_cast<long long>(batch), hashes.begin()->c_str(), scratch, err.size() > 1 ? err[1].str().c_str() : "?");
    CHECK(*hashes.begin() == std::string(scratch));  // bitwise
  }
}
#endif
