// Stage split: a Sequential cut by a balance list or by parameter count, each stage on its
// device, holding the model's own layers; bad balances are clear errors.
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
