// DataParallel: k steps match one device, gradients reach the main module once (hooks see the
// final sum), backward(losses, scale) weights shards by their share, inputs get gradients.
#include "autograd/grad_mode.h"
#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;
using namespace tandem::test;

namespace {

void check_dp_matches_one_device(const std::vector<Device>& devices, int64_t batch, bool lenet,
                                 double tol) {
  Generator gen(42);
  std::shared_ptr<nn::Module> net =
      lenet ? std::shared_ptr<nn::Module>(nn::models::lenet({}, gen)) : small_mlp(gen);
  std::shared_ptr<nn::Module> ref = net->clone();
  const auto batches = random_batches(5, batch, lenet ? Shape{1, 28, 28} : Shape{8}, gen);

  DataParallel dp(net, devices);
  nn::optim::SGD opt(dp.parameters(), 0.1, 0.9);
  std::vector<double> losses;
  for (const auto& [x, y] : batches) {
    opt.zero_grad();
    Tensor logits = dp(x);
    CHECK(logits.device() == devices[0]);
    CHECK(logits.shape()[0] == batch);
    Tensor loss = cross_entropy(logits, y.to(devices[0]));
    loss.backward();
    opt.step();
    losses.push_back(loss.item());
  }
  const ReferenceRun expect = train_reference(*ref, batches, 0.1, 0.9);
  for (size_t i = 0; i < losses.size(); ++i) CHECK(losses[i] == Approx(expect.losses[i]).epsilon(tol));
  CHECK(max_param_error(*net, *ref) <= tol);
  for (const auto& replica : dp.replicas()) {
    for (const Tensor& p : replica->parameters()) CHECK_FALSE(p.grad().defined());
  }
}

// One-device gradients of the mean loss over (x, y), for comparison.
std::vector<Tensor> reference_grads(const nn::Module& net, const Tensor& x, const Tensor& y) {
  auto copy = net.clone();
  copy->to(kCPU);
  cross_entropy(copy->forward(x), y).backward();
  std::vector<Tensor> gs;
  for (const Tensor& p : copy->parameters()) gs.push_back(p.grad());
  return gs;
}

}  // namespace

TEST_CASE("DataParallel on N virtual CPU devices matches one device", "[parallel]") {
  for (int n : {2, 3}) {
    for (int64_t batch : {12, 13}) {
      DYNAMIC_SECTION(n << " devices, batch " << batch) {
        check_dp_matches_one_device(cpu_devices(n), batch, false, 1e-5);
      }
    }
  }
  SECTION("LeNet, 2 devices, batch 13") { check_dp_matches_one_device(cpu_devices(2), 13, true, 1e-5); }
}

TEST_CASE("DataParallel runs a batch smaller than the device count on fewer devices", "[parallel]") {
  SECTION("batch 1 on 2 devices") { check_dp_matches_one_device(cpu_devices(2), 1, false, 1e-5); }
  SECTION("LeNet, batch 2 on 3 devices") { check_dp_matches_one_device(cpu_devices(3), 2, true, 1e-5); }
  SECTION("replica losses: one per shard") {
    Generator gen(5);
    auto net = small_mlp(gen);
    auto ref = net->clone();
    auto [x, y] = random_batch(2, {8}, 4, gen);
    DataParallel dp(net, cpu_devices(3));
    auto loss_fn = [](nn::Module& m, const Tensor& xs, const Tensor& ys) { return cross_entropy(m.forward(xs), ys); };
    std::vector<Tensor> losses = dp.replica_losses(x, y, loss_fn);
    CHECK(losses.size() == 2);
    CHECK(dp.last_sizes() == std::vector<int64_t>{1, 1});
    dp.backward(losses);
    const std::vector<Tensor> expect = reference_grads(*ref, x, y);
    const std::vector<Tensor> got = net->parameters();
    for (size_t k = 0; k < got.size(); ++k) CHECK(rel_error(got[k].grad(), expect[k]) <= 1e-5);
  }
}

TEST_CASE("DataParallel sums gradients into the main module, and hooks fire once", "[parallel]") {
  Generator gen(12);
  auto net = small_mlp(gen);
  auto [x, y] = random_batch(13, {8}, 4, gen);
  const auto expect = reference_grads(*net, x, y);
  DataParallel dp(net, cpu_devices(3));
  const Tensor w = dp.parameters()[0];
  int calls = 0;
  Tensor seen;
  w.register_grad_hook([&](const Tensor& g) {
    ++calls;
    seen = g.clone();
  });
  cross_entropy(dp(x), y).backward();
  CHECK(calls == 1);
  CHECK(rel_error(seen, expect[0]) < 1e-5);
  const auto params = dp.parameters();
  for (size_t k = 0; k < params.size(); ++k) CHECK(rel_error(params[k].grad(), expect[k]) < 1e-5);

  // A second backward accumulates, as on one device.
  cross_entropy(dp(x), y).backward();
  CHECK(calls == 2);
  CHECK(rel_error(params[1].grad(), mul(expect[1], 2.0)) < 1e-5);
}

TEST_CASE("DataParallel::backward weights replica losses by shard share", "[parallel]") {
  Generator gen(13);
  auto net = small_mlp(gen);
  auto [x, y] = random_batch(13, {8}, 4, gen);
  const auto expect = reference_grads(*net, x, y);
  const double expect_loss = cross_entropy(net->clone()->forward(x), y).item();
  DataParallel dp(net, cpu_devices(3));
  auto loss_fn = [](nn::Module& m, const Tensor& xs, const Tensor& ys) {
    return cross_entropy(m.forward(xs), ys);
  };
  std::vector<Tensor> losses = dp.replica_losses(x, y, loss_fn);
  REQUIRE(losses.size() == 3);
  CHECK(dp.last_sizes() == std::vector<int64_t>{5, 4, 4});
  CHECK(losses[2].device() == Device::cpu(2));
  CHECK(dp.mean_loss(losses).item() == Approx(expect_loss).epsilon(1e-6));
  dp.backward(losses, 0.5);
  const auto params = dp.parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    CHECK(rel_error(params[k].grad(), mul(expect[k], 0.5)) < 1e-5);
  }
  // mean_loss is differentiable too: the same gradient through the output device.
  dp.module().zero_grad();
  dp.mean_loss(dp.replica_losses(x, y, loss_fn)).backward();
  for (size_t k = 0; k < params.size(); ++k) CHECK(rel_error(params[k].grad(), expect[k]) < 1e-5);
  CHECK_THROWS_AS(dp.backward({losses[0]}), ValueError);
}

TEST_CASE("DataParallel passes gradients back to its input", "[parallel]") {
  Generator gen(14);
  auto net = small_mlp(gen);
  auto [x, y] = random_batch(7, {8}, 4, gen);
  Tensor x_ref = x.clone().set_requires_grad(true);
  cross_entropy(net->clone()->forward(x_ref), y).backward();
  Tensor x_dp = x.clone().set_requires_grad(true);
  DataParallel dp(net, cpu_devices(2), Device::cpu(1));
  Tensor out = dp(x_dp);
  CHECK(out.device() == Device::cpu(1));
  cross_entropy(out, y.to(Device::cpu(1))).backward();
  REQUIRE(x_dp.grad().defined());
  CHECK(rel_error(x_dp.grad(), x_ref.grad()) < 1e-5);
}

TEST_CASE("DataParallel without grad records nothing, and replicas follow the module", "[parallel]") {
  Generator gen(15);
  auto net = small_mlp(gen);
  auto [x, y] = random_batch(6, {8}, 4, gen);
  DataParallel dp(net, cpu_devices(2));
  {
    NoGradGuard no_grad;
    Tensor out = dp(x);
    CHECK_FALSE(out.requires_grad());
    CHECK(rel_error(out, net->forward(x)) < 1e-6);
  }
  // An update of the main module reaches every replica at the next forward.
  net->parameters()[0].fill_(0.25);
  Tensor out = dp(x);
  CHECK(rel_error(out, net->forward(x)) < 1e-6);
  CHECK(replicas_in_sync(dp.replicas()));
}

TEST_CASE("DataParallel coalesces the module's state and still follows a module moved away and back",
          "[parallel]") {
  Generator gen(17);
  auto net = small_mlp(gen);
  auto ref = net->clone();
  const std::vector<Tensor> params = net->parameters();
  const std::vector<Tensor> before = [&] {
    std::vector<Tensor> v;
    for (const Tensor& p : params) v.push_back(p.clone());
    return v;
  }();
  DataParallel dp(net, cpu_devices(2));
  // Same tensors (an optimizer built before wrapping keeps working), same values, one storage.
  const std::vector<Tensor> after = net->parameters();
  REQUIRE(after.size() == params.size());
  for (size_t k = 0; k < params.size(); ++k) {
    CHECK(after[k].same(params[k]));
    CHECK(rel_error(after[k], before[k]) == 0.0);
    CHECK(after[k].storage() == after[0].storage());
  }
  for (const auto& replica : dp.replicas()) {
    const std::vector<Tensor> ps = replica->parameters();
    for (const Tensor& p : ps) CHECK(p.storage() == ps[0].storage());
  }
  nn::optim::SGD opt(dp.parameters(), 0.1);
  auto batches = random_batches(3, 6, {8}, gen);
  auto step = [&](const Tensor& x, const Tensor& y) {
    opt.zero_grad();
    cross_entropy(dp(x), y).backward();
    opt.step();
  };
  step(batches[0].first, batches[0].second);
  // Moving the module away and back gives each parameter its own storage again: the replicas
  // are then updated tensor by tensor, with the same result.
  net->to(Device::cpu(1));
  net->to(Device::cpu(0));
  CHECK(net->parameters()[1].storage() != net->parameters()[0].storage());
  step(batches[1].first, batches[1].second);
  step(batches[2].first, batches[2].second);
  train_reference(*ref, batches, 0.1, 0.0);
  CHECK(max_param_error(*net, *ref) <= 1e-5);
  {
    NoGradGuard no_grad;  // the next forward brings the replicas up to date
    dp(batches[0].first);
  }
  CHECK(replicas_in_sync(dp.replicas()));
}

TEST_CASE("coalesce keeps values and identities, and is_coalesced notices a moved tensor", "[parallel]") {
  Tensor a = uniform({3, 4}, -1.0, 1.0), b = uniform({5}, -1.0, 1.0), c = uniform({2, 2, 2}, -1.0, 1.0);
  const Tensor a0 = a.clone(), b0 = b.clone(), c0 = c.clone();
  Tensor flat = coalesce({a, b, c});
  CHECK(flat.numel() == 12 + 5 + 8);
  CHECK(rel_error(a, a0) == 0.0);
  CHECK(rel_error(b, b0) == 0.0);
  CHECK(rel_error(c, c0) == 0.0);
  CHECK(is_coalesced({a, b, c}, flat));
  CHECK_FALSE(is_coalesced({b, a, c}, flat));
  CHECK_FALSE(is_coalesced({a, b}, flat));
  flat.fill_(2.0);  // the tensors are views of it
  CHECK(sum(b).item() == 10.0);
  CHECK_FALSE(coalesce({}).defined());
  CHECK(contains(error_message<DTypeError>([&] { coalesce({a, zeros({2}, kFloat64)}); }), "tensor 1"));
  CHECK(contains(error_message<ValueError>([&] { coalesce({a, a}); }), "repeats"));
}

TEST_CASE("DataParallel errors name the values", "[parallel]") {
  Generator gen(16);
  auto [x, y] = random_batch(0, {8}, 4, gen);
  DataParallel dp(small_mlp(gen), cpu_devices(3));
  CHECK(contains(error_message<ValueError>([&] { dp(x); }), "empty batch"));
  CHECK_THROWS_AS(DataParallel(small_mlp(gen), {}), ValueError);
  CHECK_THROWS_AS(DataParallel(small_mlp(gen), {Device::cpu(0), Device::cpu(0)}), ValueError);
  CHECK_THROWS_AS(DataParallel(nullptr, cpu_devices(2)), ValueError);
  std::string gpu = error_message<DeviceError>([&] {
    DataParallel(small_mlp(gen), {Device::cuda(cuda_device_count())});
  });
  CHECK(contains(gpu, "cuda:"));
}

TEST_CASE("DataParallel on two GPUs matches the CPU", "[parallel][cuda]") {
  TANDEM_REQUIRE_CUDA();
  if (!have_two_gpus()) return;
  check_dp_matches_one_device(cuda_devices(2), 13, false, 1e-4);
  check_dp_matches_one_device(cuda_devices(2), 13, true, 1e-4);
}

TEST_CASE("coalesce_by_dtype makes one flat tensor per dtype, in order of first appearance", "[parallel]") {
  Tensor a = uniform({3}, -1.0, 1.0), n = zeros({}, kInt64), b = uniform({2, 2}, -1.0, 1.0);
  Tensor m = full({2}, 7.0, kInt64), d = uniform({4}, -1.0, 1.0, kFloat64);
  const Tensor a0 = a.clone(), b0 = b.clone(), d0 = d.clone();
  CoalescedGroups g = coalesce_by_dtype({a, n, b, m, d});
  REQUIRE(g.groups.size() == 3);
  REQUIRE(g.flats.size() == 3);
  CHECK(g.flats[0].dtype() == kFloat32);
  CHECK(g.flats[1].dtype() == kInt64);
  CHECK(g.flats[2].dtype() == kFloat64);
  CHECK(g.flats[0].numel() == 3 + 4);
  CHECK(g.flats[1].numel() == 1 + 2);
  CHECK(is_coalesced({a, b}, g.flats[0]));
  CHECK(is_coalesced({n, m}, g.flats[1]));
  CHECK(is_coalesced({d}, g.flats[2]));
  CHECK(g.groups[1][1].same(m));
  CHECK(rel_error(a, a0) == 0.0);
  CHECK(rel_error(b, b0) == 0.0);
  CHECK(rel_error(d, d0) == 0.0);
  CHECK(values(m) == std::vector<double>{7.0, 7.0});
  CHECK(coalesce_by_dtype({}).groups.empty());
}

TEST_CASE("DataParallel keeps mixed-dtype buffers (BatchNorm's counter) coalesced and in sync", "[parallel]") {
  Generator gen(5);
  auto net = std::make_shared<nn::SequentialImpl>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(8, 6, true, gen), std::make_shared<nn::BatchNorm2d>(6),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(6, 4, true, gen)});
  DataParallel dp(net, cpu_devices(2));
  const std::vector<Tensor> bufs = net->buffers();  // running_mean, running_var, num_batches_tracked
  REQUIRE(bufs.size() == 3);
  CHECK(bufs[0].storage() == bufs[1].storage());  // the float32 statistics share one buffer
  CHECK(bufs[2].dtype() == kInt64);
  auto [x, y] = random_batch(12, {8}, 4, gen);
  for (int step = 0; step < 2; ++step) cross_entropy(dp(x), y).backward();
  {
    NoGradGuard no_grad;  // a forward brings every replica's buffers up to the module's
    net->eval();
    dp(x);
  }
  CHECK(net->buffers()[2].item() == 2.0);  // replica 0 counted both training forwards
  for (const auto& replica : dp.replicas()) {
    const std::vector<Tensor> rb = replica->buffers();
    REQUIRE(rb.size() == bufs.size());
    for (size_t k = 0; k < rb.size(); ++k) CHECK(values(rb[k]) == values(net->buffers()[k]));
    CHECK(rb[0].storage() == rb[1].storage());
  }
}

TEST_CASE("BatchNorm under DataParallel keeps shard 0's running statistics", "[parallel]") {
  Generator gen(17);
  auto make = [&] {
    return std::make_shared<nn::SequentialImpl>(std::initializer_list<std::shared_ptr<nn::Module>>{
        std::make_shared<nn::Linear>(8, 6, true, gen), std::make_shared<nn::BatchNorm2d>(6),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(6, 4, true, gen)});
  };
  auto net = make();
  auto shard0 = net->clone();
  auto [x, y] = random_batch(12, {8}, 4, gen);
  DataParallel dp(net, cpu_devices(2));
  cross_entropy(dp(x), y).backward();
  shard0->forward(x.slice(0, 0, 6));  // what replica 0 saw
  const auto mine = net->buffers(), want = shard0->buffers();
  REQUIRE(mine.size() == want.size());
  REQUIRE_FALSE(mine.empty());
  for (size_t k = 0; k < mine.size(); ++k) CHECK(rel_error(mine[k], want[k]) < 1e-6);

  // The trainer: parameters stay identical, running statistics are per replica.
  ScratchTrainer trainer(make(), cpu_devices(2), "ring", sgd_factory(0.1, 0.0));
  trainer.train_batch(x, y);
  CHECK(replicas_in_sync(trainer.replicas(), 0.0, /*buffers=*/false));
  CHECK_FALSE(replicas_in_sync(trainer.replicas(), 0.0, /*buffers=*/true));
}
