// Two logical devices on one GPU (Note [virtual CUDA devices] in core/device.h): copies between
// them, and the multi-device paths on them equal one-device training. Skipped without a GPU.
#include <cstdio>

#include "core/allocator.h"
#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;
using namespace tandem::test;

namespace {

// cuda:0 and one more logical device on GPU 0 for the scope: the table is the identity over
// the machine's GPUs plus cuda:N on GPU 0, so no device some other test used moves.
struct VirtualPair {
  std::vector<int> saved = virtual_cuda_devices();
  std::vector<Device> devices;
  VirtualPair() {
    const int gpus = physical_cuda_device_count();
    std::vector<int> table;
    for (int i = 0; i < gpus; ++i) table.push_back(i);
    table.push_back(0);
    set_virtual_cuda_devices(table);
    devices = {Device::cuda(0), Device::cuda(gpus)};
    REQUIRE(same_physical_device(devices[0], devices[1]));
  }
  ~VirtualPair() {
    try {
      set_virtual_cuda_devices(saved);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "could not restore the virtual CUDA devices: %s\n", e.what());
    }
  }
};

void check_trainer_matches_one_device(const std::string& comm, const std::vector<Device>& devices,
                                      int64_t batch, bool lenet) {
  Generator gen(42);
  std::shared_ptr<nn::Module> net =
      lenet ? std::shared_ptr<nn::Module>(nn::models::lenet({}, gen)) : small_mlp(gen);
  std::shared_ptr<nn::Module> ref = net->clone();
  const auto batches = random_batches(5, batch, lenet ? Shape{1, 28, 28} : Shape{8}, gen);
  ScratchTrainer trainer(net, devices, comm, sgd_factory(0.1, 0.9));
  std::vector<double> losses;
  for (const auto& [x, y] : batches) losses.push_back(trainer.train_batch(x, y).item());
  const ReferenceRun expect = train_reference(*ref, batches, 0.1, 0.9);
  for (size_t i = 0; i < losses.size(); ++i) CHECK(losses[i] == Approx(expect.losses[i]).epsilon(1e-4));
  CHECK(max_param_error(trainer.module(), *ref) <= 1e-4);
  CHECK(replicas_in_sync(trainer.replicas()));
  CHECK(static_cast<int64_t>(trainer.correct().item()) == expect.correct);
}

}  // namespace

TEST_CASE("a copy between two logical devices on one GPU", "[parallel][cuda][virtual_gpu]") {
  TANDEM_REQUIRE_CUDA();
  VirtualPair pair;
  const Device a = pair.devices[0], b = pair.devices[1];
  Generator gen(3);
  Tensor host = randn({1000, 3}, kFloat32, kCPU, &gen);  // odd size
  Tensor on_a = host.to(a);
  const size_t b_before = allocated_bytes(b);
  Tensor on_b = on_a.to(b);
  CHECK(on_b.device() == b);
  CHECK(allocated_bytes(b) >= b_before + 1000 * 3 * sizeof(float));  // counted for b, not a
  CHECK(rel_error(on_b, host) == 0);
  // Back the other way, into a view (strided, so a kernel and not one memcpy may run).
  Tensor back = zeros({3, 1000}, kFloat32, a).transpose(0, 1);
  back.copy_(on_b);
  CHECK(rel_error(back, host) == 0);
  CHECK(enable_peer_access(pair.devices));  // nothing to enable between them: true
}

TEST_CASE("ScratchTrainer on two logical devices of one GPU matches one device", "[parallel][cuda][virtual_gpu]") {
  TANDEM_REQUIRE_CUDA();
  VirtualPair pair;
  for (const std::string& comm : communicator_names(pair.devices)) {
    DYNAMIC_SECTION(comm) {
      CHECK(comm != "nccl");
      check_trainer_matches_one_device(comm, pair.devices, 13, false);
      check_trainer_matches_one_device(comm, pair.devices, 13, true);
      check_trainer_matches_one_device(comm, pair.devices, 1, false);  // one replica idle
    }
  }
}

TEST_CASE("ScratchTrainer asked for graphs on two logical devices of one GPU runs eagerly, with the reason", "[parallel][cuda][virtual_gpu]") {
  TANDEM_REQUIRE_CUDA();
  VirtualPair pair;
  Generator gen(42);
  std::shared_ptr<nn::Module> net = small_mlp(gen);
  std::shared_ptr<nn::Module> ref = net->clone();
  const auto batches = random_batches(5, 13, Shape{8}, gen);
  ScratchTrainer trainer(net, pair.devices, "ring", capturable_sgd(0.1, 0.9));
  trainer.set_cuda_graph(true);
  CHECK(contains(trainer.graph_eager_reason(), "cannot be captured per device"));
  CHECK(contains(trainer.graph_eager_reason(), "refuses devices that share a GPU"));
  for (const auto& [x, y] : batches) trainer.train_batch(x, y);
  CHECK(trainer.graph_captures() == 0);
  const ReferenceRun expect = train_reference(*ref, batches, 0.1, 0.9);
  CHECK(max_param_error(trainer.module(), *ref) <= 1e-4);
  CHECK(replicas_in_sync(trainer.replicas()));
}

TEST_CASE("DataParallel on two logical devices of one GPU matches one device", "[parallel][cuda][virtual_gpu]") {
  TANDEM_REQUIRE_CUDA();
  VirtualPair pair;
  Generator gen(42);
  std::shared_ptr<nn::Module> net = nn::models::lenet({}, gen);
  std::shared_ptr<nn::Module> ref = net->clone();
  const auto batches = random_batches(5, 13, Shape{1, 28, 28}, gen);
  DataParallel dp(net, pair.devices);  // the default communicator: not nccl on one GPU
  nn::optim::SGD opt(dp.parameters(), 0.1, 0.9);
  std::vector<double> losses;
  for (const auto& [x, y] : batches) {
    opt.zero_grad();
    Tensor logits = dp(x);
    CHECK(logits.device() == pair.devices[0]);
    Tensor loss = cross_entropy(logits, y.to(pair.devices[0]));
    loss.backward();
    opt.step();
    losses.push_back(loss.item());
  }
  const ReferenceRun expect = train_reference(*ref, batches, 0.1, 0.9);
  for (size_t i = 0; i < losses.size(); ++i) CHECK(losses[i] == Approx(expect.losses[i]).epsilon(1e-4));
  CHECK(max_param_error(*net, *ref) <= 1e-4);
}

TEST_CASE("the nccl communicator on two logical devices of one GPU is refused", "[parallel][cuda][virtual_gpu]") {
  TANDEM_REQUIRE_CUDA();
  VirtualPair pair;
  const std::string msg = error_message<DeviceError>([&] { make_communicator("nccl", pair.devices); });
  CHECK(contains(msg, "NCCL refuses two ranks on one GPU"));
  CHECK(contains(msg, "--comm ring"));
}
