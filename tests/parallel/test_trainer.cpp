// ScratchTrainer: k steps on N devices give the parameters of one device on the same global
// batches, the replicas stay identical, and the trace is valid Chrome trace JSON.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;
using namespace tandem::test;

namespace {

void check_matches_one_device(const std::string& comm, const std::vector<Device>& devices,
                              int64_t batch, bool lenet, double tol) {
  Generator gen(42);
  std::shared_ptr<nn::Module> net =
      lenet ? std::shared_ptr<nn::Module>(nn::models::lenet({}, gen)) : small_mlp(gen);
  std::shared_ptr<nn::Module> ref = net->clone();
  const Shape rest = lenet ? Shape{1, 28, 28} : Shape{8};
  const auto batches = random_batches(5, batch, rest, gen);

  ScratchTrainer trainer(net, devices, comm, sgd_factory(0.1, 0.9));
  REQUIRE(&trainer.module() == net.get());
  std::vector<double> losses;
  for (const auto& [x, y] : batches) {
    Tensor loss = trainer.train_batch(x, y);
    CHECK(loss.device() == devices[0]);
    losses.push_back(loss.item());
  }
  const ReferenceRun expect = train_reference(*ref, batches, 0.1, 0.9);
  for (size_t i = 0; i < losses.size(); ++i) CHECK(losses[i] == Approx(expect.losses[i]).epsilon(tol));
  CHECK(max_param_error(trainer.module(), *ref) <= tol);
  CHECK(replicas_in_sync(trainer.replicas()));
  CHECK(static_cast<int64_t>(trainer.correct().item()) == expect.correct);
  CHECK(trainer.examples() == 5 * batch);
}

}  // namespace

TEST_CASE("ScratchTrainer on N virtual CPU devices matches one device", "[parallel]") {
  for (const char* comm : {"naive", "ring"}) {
    for (int n : {2, 3}) {
      for (int64_t batch : {12, 13}) {
        DYNAMIC_SECTION(comm << ", " << n << " devices, batch " << batch) {
          check_matches_one_device(comm, cpu_devices(n), batch, false, 1e-5);
        }
      }
    }
  }
  SECTION("LeNet, ring, 3 devices, batch 13") {
    check_matches_one_device("ring", cpu_devices(3), 13, true, 1e-5);
  }
}

TEST_CASE("ScratchTrainer runs a batch smaller than the device count on fewer devices", "[parallel]") {
  // From the first step on: the idle replicas' gradients are attached zeros, not missing.
  SECTION("batch 1 on 2 devices") { check_matches_one_device("ring", cpu_devices(2), 1, false, 1e-5); }
  SECTION("batch 2 on 3 devices") { check_matches_one_device("naive", cpu_devices(3), 2, false, 1e-5); }
  SECTION("LeNet, batch 1 on 3 devices") { check_matches_one_device("ring", cpu_devices(3), 1, true, 1e-5); }
}

TEST_CASE("ScratchTrainer replicas stay identical over many steps", "[parallel]") {
  Generator gen(8);
  ScratchTrainer trainer(small_mlp(gen), cpu_devices(3), "ring", sgd_factory(0.05, 0.9));
  auto [x, y] = random_batch(13, {8}, 4, gen);  // one batch again and again: the loss falls
  double first = 0, last = 0;
  for (int i = 0; i < 25; ++i) {
    double loss = trainer.train_batch(x, y).item();
    if (i == 0) first = loss;
    last = loss;
  }
  CHECK(replicas_max_difference(trainer.replicas()) == 0.0);
  CHECK(last < first);
  trainer.reset_metrics();
  CHECK(trainer.correct().item() == 0.0);
  CHECK(trainer.examples() == 0);
}

TEST_CASE("ScratchTrainer errors name the values", "[parallel]") {
  Generator gen(1);
  ScratchTrainer trainer(small_mlp(gen), cpu_devices(3), "naive", sgd_factory(0.1, 0.0));
  auto [x, y] = random_batch(2, {8}, 4, gen);
  auto [x0, y0] = random_batch(0, {8}, 4, gen);
  CHECK(contains(error_message<ValueError>([&] { trainer.train_batch(x0, y0); }), "empty batch"));
  auto [x5, y5] = random_batch(5, {8}, 4, gen);
  CHECK_THROWS_AS(trainer.train_batch(x5, y), ShapeError);
  CHECK_THROWS_AS(ScratchTrainer(small_mlp(gen), cpu_devices(2), "tree", sgd_factory(0.1, 0.0)),
                  ValueError);
  CHECK_THROWS_AS(ScratchTrainer(small_mlp(gen), {Device::cpu(1), Device::cpu(1)}, "ring",
                                 sgd_factory(0.1, 0.0)),
                  ValueError);
}

TEST_CASE("replicas with different parameter shapes are rejected", "[parallel]") {
  Generator gen(2);
  auto a = small_mlp(gen);
  auto b = std::make_shared<nn::SequentialImpl>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(8, 12, true, gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(12, 4, true, gen)});
  b->to(Device::cpu(1));
  std::string msg = error_message<ShapeError>([&] { check_replicas({a, b}); });
  CHECK(contains(msg, "replica 1"));
  CHECK(contains(msg, "0.weight"));
  CHECK(contains(msg, "[12,8]"));
  CHECK(contains(msg, "[16,8]"));
  CHECK_THROWS_AS(broadcast_parameters({a, b}), ShapeError);
  CHECK_THROWS_AS(replicas_in_sync({a, b}), ShapeError);
}

TEST_CASE("broadcast_parameters brings replicas back in sync", "[parallel]") {
  Generator gen(4);
  auto devices = cpu_devices(3);
  Replicas replicas = replicate(small_mlp(gen), devices);
  CHECK(replicas_in_sync(replicas));
  replicas[2]->parameters()[0].fill_(3.0);
  CHECK_FALSE(replicas_in_sync(replicas));
  broadcast_parameters(replicas);
  CHECK(replicas_in_sync(replicas));
  replicas[1]->parameters()[1].fill_(-1.0);
  auto ring = make_communicator("ring", devices);
  broadcast_parameters(replicas, ring.get());
  CHECK(replicas_in_sync(replicas));
}

TEST_CASE("a traced step writes Chrome trace JSON", "[parallel]") {
  Generator gen(6);
  auto devices = cpu_devices(2);
  ScratchTrainer trainer(small_mlp(gen), devices, "ring", sgd_factory(0.1, 0.0));
  Trace trace(devices);
  trainer.set_trace(&trace);
  auto [x, y] = random_batch(8, {8}, 4, gen);
  trainer.train_batch(x, y);
  trainer.train_batch(x, y);
  trainer.set_trace(nullptr);
  trainer.train_batch(x, y);
  CHECK(trace.size() == 2 * 2 * 3);  // steps x devices x (compute, allreduce, optimizer)
  const std::string json = trace.json();
  CHECK(contains(json, "\"traceEvents\""));
  CHECK(contains(json, "\"ph\": \"X\""));
  CHECK(contains(json, "forward+backward"));
  CHECK(contains(json, "allreduce ring"));
  CHECK(contains(json, "\"name\": \"cpu:1\""));
  CHECK(contains(json, "\"name\": \"comm\""));
  const std::string path = "tandem_test_trace.json.trace";
  trace.write(path);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  CHECK(text.str() == json);
  std::remove(path.c_str());
  CHECK_THROWS_AS(trace.span(Device::cpu(5), "x"), DeviceError);
}

TEST_CASE("ScratchTrainer on two GPUs matches the CPU", "[parallel][cuda]") {
  TANDEM_REQUIRE_CUDA();
  if (!have_two_gpus()) return;
  for (const std::string& comm : communicator_names(cuda_devices(2))) {
    DYNAMIC_SECTION(comm) {
      check_matches_one_device(comm, cuda_devices(2), 13, false, 1e-4);
      check_matches_one_device(comm, cuda_devices(2), 13, true, 1e-4);
    }
  }
}

namespace {

// Two trainers from the same LeNet, one with a CUDA graph per replica: 6 batches of 16, a
// short one of 10, a learning-rate change, 3 more of 16. Returns the graphed trainer's losses
// and checks it against the eager one bit for bit on the way.
void check_graphed_equals_eager(const std::vector<Device>& devices, const std::string& comm,
                                const parallel::OptimizerFactory& make_opt, int64_t want_replays) {
  Generator gen(11);
  std::shared_ptr<nn::Module> init = nn::models::lenet({}, gen);
  ScratchTrainer eager(init->clone(), devices, comm, make_opt), graphed(init->clone(), devices, comm, make_opt);
  graphed.set_cuda_graph(true);
  auto batches = random_batches(6, 16, {1, 28, 28}, gen);
  batches.push_back(random_batch(10, {1, 28, 28}, 4, gen));
  for (const auto& b : random_batches(3, 16, {1, 28, 28}, gen)) batches.push_back(b);
  for (size_t i = 0; i < batches.size(); ++i) {
    if (i == 7) {
      for (size_t r = 0; r < devices.size(); ++r) {
        eager.optimizer(r).set_lr(0.05);
        graphed.optimizer(r).set_lr(0.05);
      }
    }
    const Tensor x = batches[i].first.to(devices[0]), y = batches[i].second.to(devices[0]);
    const double le = eager.train_batch(x, y).item(), lg = graphed.train_batch(x, y).item();
    INFO("step " << i);
    CHECK(lg == le);
  }
  CHECK(graphed.graph_replays() == want_replays);
  CHECK(graphed.graph_captures() == (want_replays > 0 ? 1 : 0));
  CHECK(values(graphed.correct()) == values(eager.correct()));
  for (size_t r = 0; r < devices.size(); ++r) {
    const auto pe = eager.replicas()[r]->state_dict(), pg = graphed.replicas()[r]->state_dict();
    for (const auto& [name, t] : pe) {
      INFO("replica " << r << " " << name);
      CHECK(values(pg.at(name)) == values(t));
    }
  }
}

}  // namespace

TEST_CASE("ScratchTrainer with a CUDA graph per replica equals eager steps bit for bit", "[parallel][cuda]") {
  TANDEM_REQUIRE_CUDA();
  // Steps 1-2 warm up, 3 captures and replays, 4-6 replay, the short 7th runs eagerly, 8-10
  // replay after the learning-rate change (a capturable optimizer: no new capture).
  SECTION("one GPU") { check_graphed_equals_eager(cuda_devices(1), "naive", capturable_sgd(0.1, 0.9), 7); }
  SECTION("two GPUs, NCCL's allreduce captured in each graph") {
    if (!have_two_gpus()) return;
    check_graphed_equals_eager(cuda_devices(2), "nccl", capturable_sgd(0.1, 0.9), 7);
  }
  SECTION("optimizers that are not capturable: eager, with the reason") {
    check_graphed_equals_eager(cuda_devices(1), "naive", sgd_factory(0.1, 0.9), 0);
    Generator gen(3);
    ScratchTrainer t(nn::models::lenet({}, gen), cuda_devices(1), "naive", sgd_factory(0.1, 0.9));
    t.set_cuda_graph(true);
    CHECK(contains(t.graph_eager_reason(), "not capturable"));
  }
}

TEST_CASE("ScratchTrainer runs CPU devices eagerly when asked for CUDA graphs", "[parallel]") {
  Generator gen(5);
  ScratchTrainer t(small_mlp(gen), cpu_devices(2), "ring", capturable_sgd(0.1, 0.9));
  t.set_cuda_graph(true);
  CHECK(contains(t.graph_eager_reason(), "need GPUs"));
  const auto [x, y] = random_batch(8, {8}, 4, gen);
  for (int i = 0; i < 4; ++i) t.train_batch(x, y);
  CHECK(t.graph_captures() == 0);
  CHECK(t.graph_replays() == 0);
  CHECK(replicas_in_sync(t.replicas()));
  t.set_cuda_graph(false);
  CHECK(t.graph_eager_reason().empty());
}
