// Stage split: a Sequential cut by a balance list, by parameter count or by measured time, each
// stage on its device, holding the model's own layers; the min-max partition against every
// partition; profiling leaves the model as it was; bad balances and inputs are clear errors.
#include <algorithm>
#include <cmath>
#include <limits>

#include "autograd/grad_mode.h"
#include "core/allocator.h"
#include "nn/models/lenet.h"
#include "parallel/pipeline/split.h"
#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;
using namespace tandem::parallel::pipeline;

namespace {

std::shared_ptr<nn::SequentialImpl> linears(const std::vector<int64_t>& in_features, Generator& gen) {
  auto seq = std::make_shared<nn::SequentialImpl>();
  for (int64_t in : in_features) seq->push_back(std::make_shared<nn::Linear>(in, 5, true, gen));
  return seq;
}

// The pieces of `costs` cut before the layers in `starts` (ascending, each in [1, L)).
std::vector<int64_t> balance_of(const std::vector<size_t>& starts, size_t L) {
  std::vector<int64_t> b;
  size_t begin = 0;
  for (size_t c : starts) {
    b.push_back(static_cast<int64_t>(c - begin));
    begin = c;
  }
  b.push_back(static_cast<int64_t>(L - begin));
  return b;
}

// Note [balance ties] as an order: (M_P, c_P, M_{P-1}, c_{P-1}, ..., M_2, c_2), with M_k the
// largest sum of pieces 1..k and c_k the first layer of piece k.
std::vector<double> tie_key(const std::vector<double>& costs, const std::vector<int64_t>& b) {
  std::vector<double> sums, starts;
  size_t at = 0;
  for (int64_t n : b) {
    starts.push_back(static_cast<double>(at));
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += costs[at++];
    sums.push_back(sum);
  }
  std::vector<double> key;
  for (size_t k = b.size(); k >= 1; --k) {
    key.push_back(*std::max_element(sums.begin(), sums.begin() + static_cast<std::ptrdiff_t>(k)));
    if (k >= 2) key.push_back(starts[k - 1]);
  }
  return key;
}

// Every contiguous split of costs into P pieces, the least by tie_key.
std::vector<int64_t> brute_force_balance(const std::vector<double>& costs, size_t P) {
  const size_t L = costs.size();
  std::vector<int64_t> best;
  std::vector<double> best_key;
  std::vector<bool> chosen(L - 1, false);  // a cut before layer i + 1
  std::fill(chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(P - 1), true);
  do {
    std::vector<size_t> starts;
    for (size_t i = 0; i + 1 < L; ++i)
      if (chosen[i]) starts.push_back(i + 1);
    const auto b = balance_of(starts, L);
    const auto key = tie_key(costs, b);
    if (best.empty() || key < best_key) {
      best = b;
      best_key = key;
    }
  } while (std::prev_permutation(chosen.begin(), chosen.end()));
  return best;
}

double largest_piece(const std::vector<double>& costs, const std::vector<int64_t>& b) {
  return tie_key(costs, b).front();
}

// Conv -> BatchNorm -> ReLU -> Flatten -> Linear on [N, 2, 6, 6]: parameters, buffers, a mode.
std::shared_ptr<nn::SequentialImpl> conv_bn_net(Generator& gen) {
  auto seq = std::make_shared<nn::SequentialImpl>();
  seq->push_back(std::make_shared<nn::Conv2d>(2, 4, 3, 1, 0, true, gen));
  seq->push_back(std::make_shared<nn::BatchNorm2d>(4));
  seq->push_back(std::make_shared<nn::ReLU>());
  seq->push_back(std::make_shared<nn::Flatten>());
  seq->push_back(std::make_shared<nn::Linear>(4 * 4 * 4, 3, true, gen));
  return seq;
}

}  // namespace

TEST_CASE("split_by_balance: consecutive layers on each device are the model's own",
          "[parallel][pipeline]") {
  Generator gen(5);
  auto model = nn::models::lenet({}, gen);
  auto [x, y] = test::random_batch(3, {1, 28, 28}, 10, gen);
  const Tensor expected = model->forward(x);
  const auto before = model->parameters();
  std::vector<void*> data;
  for (const Tensor& p : before) data.push_back(p.raw_data());

  const auto stages = split_by_balance(*model, {3, 4, 5}, cpu_devices(3));
  REQUIRE(stages.size() == 3);
  CHECK(stages[0].begin == 0);
  CHECK(stages[0].end == 3);
  CHECK(stages[1].begin == 3);
  CHECK(stages[2].end == 12);
  CHECK(stages[1].module->size() == 4);
  std::vector<Tensor> params;
  for (size_t s = 0; s < stages.size(); ++s) {
    CHECK(stages[s].device == Device::cpu(static_cast<int>(s)));
    for (const Tensor& p : stages[s].module->parameters()) {
      CHECK(p.device() == stages[s].device);
      params.push_back(p);
    }
  }
  // The same parameters as the model's, moved, in the model's order: an optimizer over
  // model->parameters() trains the stages.
  const auto after = model->parameters();
  REQUIRE(after.size() == params.size());
  for (size_t k = 0; k < params.size(); ++k) {
    CHECK(after[k].raw_data() == params[k].raw_data());
    CHECK(after[k].device() == params[k].device());
  }
  // The stages one after another compute the model.
  Tensor h = x.to(Device::cpu(0));
  for (const auto& st : stages) h = st.module->forward(h.to(st.device));
  CHECK(test::rel_error(h, expected) < 1e-6);
}

TEST_CASE("balance_by_parameters: the largest stage as small as it can be",
          "[parallel][pipeline]") {
  Generator gen(6);
  auto seq = linears({1, 1, 1, 5}, gen);  // 10, 10, 10, 30 parameters
  CHECK(balance_by_parameters(*seq, 1) == std::vector<int64_t>{4});
  CHECK(balance_by_parameters(*seq, 2) == std::vector<int64_t>{3, 1});  // 30 | 30
  CHECK(balance_by_parameters(*seq, 3) ==
        std::vector<int64_t>{1, 2, 1});  // 10 | 20 | 30: ties go early
  CHECK(balance_by_parameters(*seq, 4) == std::vector<int64_t>{1, 1, 1, 1});
  auto big_first = linears({5, 1, 1, 1}, gen);  // 30, 10, 10, 10
  CHECK(balance_by_parameters(*big_first, 2) == std::vector<int64_t>{1, 3});

  // LeNet: Linear(400, 120) holds 48,120 of 61,706 parameters; no stage can hold less.
  auto lenet = nn::models::lenet({}, gen);
  for (int P : {2, 4}) {
    const auto b = balance_by_parameters(*lenet, P);
    REQUIRE(b.size() == static_cast<size_t>(P));
    const auto stages = split_by_parameters(*lenet, cpu_devices(P));
    int64_t largest = 0, layers = 0;
    for (const auto& st : stages) {
      largest = std::max(largest, st.module->num_parameters());
      layers += static_cast<int64_t>(st.module->size());
    }
    CHECK(layers == 12);
    CHECK(largest == (P == 2 ? 48120 + 2416 + 156 : 48120));
  }
}

TEST_CASE("stage split: bad balances and too many stages are clear errors",
          "[parallel][pipeline]") {
  Generator gen(7);
  auto seq = linears({1, 1, 1}, gen);
  auto msg = [&](const std::vector<int64_t>& b, int devices) {
    return test::error_message<ValueError>(
        [&] { split_by_balance(*seq, b, cpu_devices(devices)); });
  };
  CHECK(test::contains(msg({1, 1}, 2),
                       "balance [1, 1] adds up to 2 layers but the Sequential has 3"));
  CHECK(test::contains(msg({1, 1, 1, 1}, 4), "4 stages for a Sequential of 3 layers"));
  CHECK(test::contains(msg({3, 0}, 2), "gives stage 1 0 layers"));
  CHECK(test::contains(msg({2, 1}, 3), "balance [2, 1] has 2 stages but there are 3 devices"));
  CHECK(test::contains(test::error_message<ValueError>([&] { balance_by_parameters(*seq, 4); }),
                       "4 stages for a Sequential of 3 layers"));
  CHECK(test::contains(test::error_message<ValueError>([&] { balance_by_parameters(*seq, 0); }),
                       "num_stages must be >= 1, got 0"));
  CHECK(test::contains(test::error_message<ValueError>([&] {
                         split_by_balance(*seq, {2, 1}, {Device::cpu(0), Device::cpu(0)});
                       }),
                       "has cpu:0 twice"));
}

TEST_CASE("balance_min_max: the exact split, ties as Note [balance ties] says, against every split",
          "[parallel][pipeline]") {
  Generator gen(8);
  for (size_t L = 1; L <= 9; ++L) {
    for (size_t P = 1; P <= std::min<size_t>(5, L); ++P) {
      for (int trial = 0; trial < 20; ++trial) {
        // Small whole numbers tie often (the rule decides); uniform doubles almost never do.
        std::vector<double> ints, reals;
        for (size_t i = 0; i < L; ++i) {
          ints.push_back(static_cast<double>(gen.next_u64() % 4));
          double u = 0;
          gen.uniform(&u, 1, 0.0, 1.0);
          reals.push_back(u);
        }
        for (const auto& costs : {ints, reals}) {
          const auto b = balance_min_max(costs, static_cast<int>(P));
          const auto expected = brute_force_balance(costs, P);
          INFO("L " << L << ", P " << P << ", got " << balance_str(b) << ", brute force "
                    << balance_str(expected));
          CHECK(b == expected);
          CHECK(largest_piece(costs, b) == largest_piece(costs, expected));
        }
      }
    }
  }
}

TEST_CASE("balance_min_max: known splits and ties", "[parallel][pipeline]") {
  using B = std::vector<int64_t>;
  CHECK(balance_min_max({1, 1, 1, 10}, 2) == B{3, 1});
  CHECK(balance_min_max({10, 1, 1, 1}, 2) == B{1, 3});
  CHECK(balance_min_max({1, 2, 3, 4, 5, 6, 7, 8, 9}, 3) == B{5, 2, 2});  // 15 | 13 | 17
  CHECK(balance_min_max({1, 1, 1, 1}, 2) == B{2, 2});
  CHECK(balance_min_max({4, 1, 1, 1, 1, 1}, 1) == B{6});
  CHECK(balance_min_max({4, 1, 1}, 3) == B{1, 1, 1});
  // Ties: the last stage as long as the optimum lets it be, the layers before it split at
  // their own best: 2 | 2 | 3, not 1 | 3 | 3.
  CHECK(balance_min_max({1, 1, 1, 1, 3}, 3) == B{2, 2, 1});
  CHECK(balance_min_max({0, 0, 0, 0}, 2) == B{1, 3});
  CHECK(balance_min_max({0, 5, 0}, 2) == B{1, 2});
  CHECK(balance_min_max({10, 10, 10, 30}, 3) == B{1, 2, 1});  // balance_by_parameters' case
}

TEST_CASE("balance_min_max, balance_by_time and layer_times: bad input is a clear error",
          "[parallel][pipeline]") {
  auto msg = [](auto&& f) { return test::error_message<ValueError>(f); };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  CHECK(test::contains(msg([] { balance_min_max({1, 2}, 0); }),
                       "balance_min_max: num_stages must be >= 1, got 0"));
  CHECK(test::contains(msg([] { balance_min_max({1, 2}, 3); }),
                       "balance_min_max: 3 stages for 2 costs; every stage needs a layer"));
  CHECK(test::contains(msg([] { balance_min_max({}, 1); }), "1 stages for 0 costs"));
  CHECK(test::contains(msg([] { balance_min_max({1, -2, 3}, 2); }),
                       "balance_min_max: costs[1] = -2 is negative"));
  CHECK(test::contains(msg([&] { balance_min_max({1, 2, nan}, 2); }), "costs[2] = "));
  CHECK(test::contains(msg([&] { balance_min_max({1, 2, nan}, 2); }), "is not finite"));
  CHECK(test::contains(msg([&] { balance_min_max({inf, 2}, 2); }),
                       "balance_min_max: costs[0] = inf is not finite"));
  CHECK(test::contains(msg([] { balance_by_time({0.5, -1.0}, 2); }),
                       "balance_by_time: times[1] = -1 is negative"));
  CHECK(test::contains(msg([] { balance_by_time({0.5, 1.0}, 3); }),
                       "balance_by_time: 3 stages for 2 layer times"));
  CHECK(test::contains(msg([] { balance_by_time({0.5, 1.0}, -1); }),
                       "balance_by_time: num_stages must be >= 1, got -1"));

  Generator gen(9);
  auto lenet = nn::models::lenet({}, gen);
  const Tensor sample = randn({2, 1, 28, 28}, kFloat32, kCPU, &gen);
  // The stage count is checked before anything is measured.
  CHECK(test::contains(msg([&] { balance_by_time(*lenet, sample, 13); }),
                       "balance_by_time: 13 stages for a Sequential of 12 layers"));
  CHECK(test::contains(msg([&] { balance_by_time(*lenet, sample, 0); }),
                       "balance_by_time: num_stages must be >= 1, got 0"));
  CHECK(test::contains(msg([&] { balance_by_time(*lenet, Tensor(), 2); }),
                       "layer_times: the sample is an undefined tensor"));
  CHECK(test::contains(msg([&] { layer_times(*lenet, sample, 0); }),
                       "layer_times: repeats must be >= 1, got 0"));
  CHECK(test::contains(msg([&] { layer_times(nn::SequentialImpl(), sample, 1); }),
                       "layer_times: the Sequential has no layers"));
  // A model already cut into stages is on several devices: profile it before the split.
  split_by_balance(*lenet, {6, 6}, cpu_devices(2));
  CHECK(test::contains(msg([&] { layer_times(*lenet, sample, 1); }),
                       "layer_times: the model's tensors are on cpu:0 and cpu:1"));
}

TEST_CASE("layer_times: one time per layer, and the model left as it was", "[parallel][pipeline]") {
  Generator gen(10);
  for (bool training : {true, false}) {
    for (bool with_grads : {true, false}) {
      auto net = conv_bn_net(gen);
      const Tensor x = randn({5, 2, 6, 6}, kFloat32, kCPU, &gen);
      if (with_grads) sum(net->forward(x)).backward();  // .grad defined, running stats moved
      net->train(training);
      (*net)[2]->train(!training);  // a mode that differs inside the tree is kept too
      nn::StateDict before;
      for (const auto& [name, t] : net->state_dict()) before.insert(name, t.clone());
      std::vector<Tensor> grads;
      for (const Tensor& p : net->parameters())
        grads.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
      std::vector<bool> modes;
      net->apply([&](nn::Module& m) { modes.push_back(m.is_training()); });
      const size_t live = allocated_bytes(kCPU);

      std::vector<double> times;
      {
        NoGradGuard no_grad;  // the profile records its own graphs all the same
        times = layer_times(*net, x, 3);
        CHECK_FALSE(grad_enabled());
      }
      INFO("training " << training << ", with grads " << with_grads);
      REQUIRE(times.size() == net->size());
      for (double t : times) {
        CHECK(std::isfinite(t));
        CHECK(t > 0);
      }
      // Nothing kept: the copies, their gradients and graphs are gone.
      CHECK(allocated_bytes(kCPU) == live);
      for (const auto& [name, t] : net->state_dict()) {
        INFO(name);
        CHECK(test::values(t) == test::values(before.at(name)));
      }
      const auto params = net->parameters();
      for (size_t k = 0; k < params.size(); ++k) {
        REQUIRE(params[k].grad().defined() == grads[k].defined());
        if (grads[k].defined()) CHECK(test::values(params[k].grad()) == test::values(grads[k]));
      }
      std::vector<bool> modes_after;
      net->apply([&](nn::Module& m) { modes_after.push_back(m.is_training()); });
      CHECK(modes_after == modes);
    }
  }
}

TEST_CASE("balance_by_time: a stage for the layer that does the work, where parameters say otherwise",
          "[parallel][pipeline]") {
  // ReLU, ReLU, Linear(512, 512), ReLU, ReLU on 64 rows: the Linear's forward + backward takes
  // about a hundred times a ReLU's, and it holds every parameter. By parameter count the last
  // stage takes it and both ReLUs after it (ties: the last stage as long as it can be); by time
  // it is a stage alone, the only split whose largest stage is the Linear's time.
  Generator gen(11);
  auto seq = std::make_shared<nn::SequentialImpl>();
  seq->push_back(std::make_shared<nn::ReLU>());
  seq->push_back(std::make_shared<nn::ReLU>());
  seq->push_back(std::make_shared<nn::Linear>(512, 512, true, gen));
  seq->push_back(std::make_shared<nn::ReLU>());
  seq->push_back(std::make_shared<nn::ReLU>());
  const Tensor sample = randn({64, 512}, kFloat32, kCPU, &gen);
  const auto times = layer_times(*seq, sample, 5);
  INFO("times (s): " << times[0] << " " << times[1] << " " << times[2] << " " << times[3] << " "
                     << times[4]);
  CHECK(times[2] > 2 * std::max({times[0] + times[1], times[3] + times[4]}));
  CHECK(balance_by_time(times, 3) == std::vector<int64_t>{2, 1, 2});
  CHECK(balance_by_time(*seq, sample, 3) == std::vector<int64_t>{2, 1, 2});
  CHECK(balance_by_parameters(*seq, 3) == std::vector<int64_t>{1, 1, 3});
}
