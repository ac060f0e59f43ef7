// Tensor parallelism in one process: Megatron's f and g against closed-form sums, a split
// MLP equal to the unsplit one (forward and gradients), and LeNet with its classifier split
// over 2 and 4 virtual devices training to the parameters of one-device LeNet
// (Note [tensor-parallel ranks in one graph]).
//
// Tolerances: forward and gradients 1e-6 relative (a product split in k-slices and summed
// rounds in another order); after 3 SGD steps 1e-5.
#include <cstdio>

#include "nn/models/lenet.h"
#include "parallel/tensor_parallel.h"
#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;

namespace {

// Device i gets a [2, 3] tensor filled with i + 1 that requires grad.
std::vector<Tensor> filled(const std::vector<Device>& devices) {
  std::vector<Tensor> xs;
  for (size_t i = 0; i < devices.size(); ++i) {
    Tensor x = full({2, 3}, double(i + 1), kFloat32, devices[i]);
    x.set_requires_grad(true);
    xs.push_back(x);
  }
  return xs;
}

// sum_i (i + 1) * sum(ys[i]), moved to device 0: device i's output gets gradient i + 1.
Tensor weighted_sum(const std::vector<Tensor>& ys) {
  Tensor total;
  for (size_t i = 0; i < ys.size(); ++i) {
    Tensor t = to_device(sum(ys[i]) * double(i + 1), ys[0].device());
    total = total.defined() ? total + t : t;
  }
  return total;
}

// sum_r L_r on device 0 (Note [tensor-parallel ranks in one graph]).
Tensor seed_every_rank(const std::vector<Tensor>& losses) {
  Tensor total = losses[0];
  for (size_t r = 1; r < losses.size(); ++r)
    total = total + to_device(losses[r], losses[0].device());
  return total;
}

}  // namespace

TEST_CASE("Megatron f is identity forward and allreduce backward and g the converse",
          "[parallel][tensor-parallel]") {
  for (int n : {2, 4}) {
    const auto devices = cpu_devices(n);
    auto comm = make_communicator("ring", devices);
    const double weights = n * (n + 1) / 2.0;  // 1 + 2 + ... + n

    auto xs = filled(devices);
    auto ys = copy_to_tensor_parallel_region(*comm, xs);
    for (int i = 0; i < n; ++i) CHECK(test::values(ys[i]) == std::vector<double>(6, i + 1.0));
    weighted_sum(ys).backward();
    for (int i = 0; i < n; ++i)
      CHECK(test::values(xs[i].grad()) == std::vector<double>(6, weights));

    auto ps = filled(devices);
    auto sums = reduce_from_tensor_parallel_region(*comm, ps);
    for (int i = 0; i < n; ++i) {
      CHECK(sums[i].device() == devices[i]);
      CHECK(test::values(sums[i]) == std::vector<double>(6, weights));
    }
    weighted_sum(sums).backward();
    for (int i = 0; i < n; ++i)
      CHECK(test::values(ps[i].grad()) == std::vector<double>(6, i + 1.0));
  }
  auto comm = make_communicator("naive", cpu_devices(2));
  CHECK(test::contains(
      test::error_message<ValueError>([&] { copy_to_tensor_parallel_region(*comm, {ones({2})}); }),
      "1 tensors for 2 devices"));
  CHECK(test::contains(test::error_message<DeviceError>([&] {
                         reduce_from_tensor_parallel_region(*comm, {ones({2}), ones({2})});
                       }),
                       "tensor 1 is on cpu:0, not on cpu:1"));
  Generator gen(1);
  nn::Linear narrow(8, 3, true, gen);
  auto four = make_communicator("ring", cpu_devices(4));
  CHECK(
      test::contains(test::error_message<ValueError>([&] { ColumnParallelLinear(narrow, *four); }),
                     "3 output features over 4 devices"));
}

TEST_CASE("tensor_parallel_range cuts features as torch.tensor_split and shards take one tensor",
          "[parallel][tensor-parallel]") {
  using Range = std::pair<int64_t, int64_t>;
  const std::vector<Range> expected = {{0, 3}, {3, 6}, {6, 8}, {8, 10}};
  for (int r = 0; r < 4; ++r) CHECK(tensor_parallel_range(10, 4, r) == expected[size_t(r)]);
  CHECK(tensor_parallel_range(120, 7, 6) == Range{103, 120});
  CHECK(test::contains(test::error_message<ValueError>([] { tensor_parallel_range(3, 4, 0); }),
                       "3 features over 4 shards"));
  CHECK(test::contains(test::error_message<ValueError>([] { tensor_parallel_range(8, 4, 4); }),
                       "shard 4 of 4"));
  // The one-tensor forward is for a process that holds one shard; in one process it says so.
  Generator gen(2);
  nn::Linear fc(6, 4, true, gen);
  auto comm = make_communicator("ring", cpu_devices(2));
  ColumnParallelLinear col(fc, *comm);
  CHECK(col.comm().world_size() == 2);
  CHECK(col.comm().holds_all());
  CHECK(test::contains(test::error_message<ValueError>([&] { col.forward(ones({1, 6})); }),
                       "this process holds 2 shards"));
}

TEST_CASE("a column then row parallel MLP equals the unsplit one", "[parallel][tensor-parallel]") {
  Generator gen(8);
  nn::Linear fc1(8, 10, true, gen), fc2(10, 4, true, gen);  // 10 and 8 do not split evenly over 4
  auto [x, y] = test::random_batch(5, {8}, 4, gen);
  Tensor loss = cross_entropy(fc2.forward(relu(fc1.forward(x))), y);
  loss.backward();

  for (int n : {2, 4}) {
    const auto devices = cpu_devices(n);
    auto comm = make_communicator("ring", devices);
    ColumnParallelLinear col(fc1, *comm);
    RowParallelLinear row(fc2, *comm);
    CHECK(test::rel_error(col.full_weight(), fc1.weight()) == 0.0);
    CHECK(test::rel_error(row.full_weight(), fc2.weight()) == 0.0);
    CHECK(col.shards()[n - 1]->out_features() == (n == 2 ? 5 : 2));

    std::vector<Tensor> xs;
    for (Device d : devices) xs.push_back(x.to(d));
    auto hs = col(xs);
    for (Tensor& h : hs) h = relu(h);
    auto outs = row(hs);
    std::vector<Tensor> losses;
    for (int r = 0; r < n; ++r) {
      losses.push_back(cross_entropy(outs[r], y.to(devices[r])));
      CHECK(std::abs(losses[r].item() - loss.item()) < 1e-6);
    }
    seed_every_rank(losses).backward();

    // Shard i's gradient is its slice of the unsplit layer's gradient.
    std::vector<Tensor> g1, g1b, g2;
    for (const auto& s : col.shards()) {
      g1.push_back(s->weight().grad().to(kCPU));
      g1b.push_back(s->bias().grad().to(kCPU));
    }
    for (const auto& s : row.shards()) g2.push_back(s->weight().grad().to(kCPU));
    INFO(n << " shards");
    CHECK(test::rel_error(cat(g1, 0), fc1.weight().grad()) < 1e-6);
    CHECK(test::rel_error(cat(g1b, 0), fc1.bias().grad()) < 1e-6);
    CHECK(test::rel_error(cat(g2, 1), fc2.weight().grad()) < 1e-6);
    CHECK(test::rel_error(row.shards()[0]->bias().grad(), fc2.bias().grad()) < 1e-6);
  }
}

namespace {

// LeNet with Linear(400, 120) column-parallel and Linear(120, 84) row-parallel over `n`
// devices; the convolutions and Linear(84, 10) replicated on every device, as Megatron keeps
// the layers it does not split.
struct TensorParallelLeNet {
  std::vector<Device> devices;
  std::unique_ptr<Communicator> comm;
  std::vector<std::shared_ptr<nn::SequentialImpl>> features;  // layers 0..6 per device
  std::vector<std::shared_ptr<nn::Module>> head;          // layer 11 per device
  std::unique_ptr<ColumnParallelLinear> fc1;
  std::unique_ptr<RowParallelLinear> fc2;

  TensorParallelLeNet(const nn::SequentialImpl& lenet, int n)
      : devices(cpu_devices(n)), comm(make_communicator("ring", devices)) {
    for (Device d : devices) {
      auto f = std::make_shared<nn::SequentialImpl>();
      for (size_t i = 0; i < 7; ++i) f->push_back(lenet[i]->clone());
      f->to(d);
      features.push_back(f);
      auto h = lenet[11]->clone();
      h->to(d);
      head.push_back(h);
    }
    fc1 = std::make_unique<ColumnParallelLinear>(lenet.at<nn::Linear>(7), *comm);
    fc2 = std::make_unique<RowParallelLinear>(lenet.at<nn::Linear>(9), *comm);
  }

  std::vector<Tensor> parameters() const {
    std::vector<Tensor> out;
    for (size_t r = 0; r < devices.size(); ++r) {
      for (const Tensor& p : features[r]->parameters()) out.push_back(p);
      for (const Tensor& p : head[r]->parameters()) out.push_back(p);
    }
    for (const Tensor& p : fc1->parameters()) out.push_back(p);
    for (const Tensor& p : fc2->parameters()) out.push_back(p);
    return out;
  }

  // The loss of the batch (every device's is the same); backward through all of them.
  double train_batch(const Tensor& x, const Tensor& y) {
    std::vector<Tensor> hs;
    for (size_t r = 0; r < devices.size(); ++r)
      hs.push_back(features[r]->forward(x.to(devices[r])));
    auto a = (*fc1)(hs);
    for (Tensor& t : a) t = relu(t);
    auto b = (*fc2)(a);
    std::vector<Tensor> losses;
    for (size_t r = 0; r < devices.size(); ++r) {
      losses.push_back(cross_entropy(head[r]->forward(relu(b[r])), y.to(devices[r])));
    }
    seed_every_rank(losses).backward();
    return losses[0].item();
  }
};

}  // namespace

TEST_CASE("LeNet with its classifier split over 2 and 4 devices trains as unsplit LeNet",
          "[parallel][tensor-parallel]") {
  constexpr int kSteps = 3;
  auto make = [] {
    Generator gen(31);
    return nn::models::lenet({nn::models::LeNetActivation::ReLU, 10}, gen);
  };
  Generator data_gen(32);
  std::vector<std::pair<Tensor, Tensor>> batches;
  for (int k = 0; k < kSteps; ++k)
    batches.push_back(test::random_batch(9, {1, 28, 28}, 10, data_gen));

  auto one = make();
  const auto reference = test::train_reference(*one, batches, 0.1, 0.9);
  CHECK(test::max_param_error(*one, *make()) > 1e-3);

  for (int n : {2, 4}) {
    auto start = make();
    TensorParallelLeNet tp(*start, n);
    nn::optim::SGD opt(tp.parameters(), 0.1, 0.9);
    for (int k = 0; k < kSteps; ++k) {
      opt.zero_grad();
      const double loss = tp.train_batch(batches[k].first, batches[k].second);
      CHECK(std::abs(loss - reference.losses[k]) <= 1e-5 * reference.losses[k]);
      opt.step();
    }
    INFO(n << " devices");
    double worst = 0;
    auto check = [&](const Tensor& got, const Tensor& want) {
      const double e = test::rel_error(got, want);
      worst = std::max(worst, e);
      CHECK(e <= 1e-5);
    };
    for (size_t r = 0; r < tp.devices.size(); ++r) {
      const auto fp = tp.features[r]->parameters(), hp = tp.head[r]->parameters();
      check(fp[0], one->at(0).parameters()[0]);
      check(fp[1], one->at(0).parameters()[1]);
      check(fp[2], one->at(3).parameters()[0]);
      check(fp[3], one->at(3).parameters()[1]);
      check(hp[0], one->at<nn::Linear>(11).weight());
      check(hp[1], one->at<nn::Linear>(11).bias());
    }
    check(tp.fc1->full_weight(), one->at<nn::Linear>(7).weight());
    check(tp.fc1->full_bias(), one->at<nn::Linear>(7).bias());
    check(tp.fc2->full_weight(), one->at<nn::Linear>(9).weight());
    check(tp.fc2->full_bias(), one->at<nn::Linear>(9).bias());
    std::printf(
        "tensor parallel LeNet classifier on %d devices vs one device, %d steps: max rel error "
        "%.3g\n",
        n, kSteps, worst);
  }
}
