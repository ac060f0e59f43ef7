// The in-process pipeline executor: plain model parallelism (M = 1), GPipe and 1F1B on 2 and
// 4 virtual CPU devices reach the parameters of one-device training on the same global batch
// (LeNet, SGD with momentum and Adam; also cut by measured time), hold the activations the
// schedule says, and fail clearly and promptly.
//
// Tolerance 1e-5 relative (measured: a few 1e-7). The pipeline computes each micro-batch's
// mean loss times n_m / B and sums the micro-batches' gradients in .grad, where one device
// sums all B rows in one GEMM and divides by B: the same math rounded in another order
// (Note [loss scaling for micro-batches]). With M = 1 the arithmetic is the same as one
// device's, stage by stage, so those runs are checked bitwise.
#include <chrono>
#include <cstdio>

#include "core/allocator.h"
#include "nn/models/lenet.h"
#include "parallel/pipeline/microbatch.h"
#include "parallel/pipeline/pipeline.h"
#include "parallel/pipeline/split.h"
#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;
using namespace tandem::parallel::pipeline;

namespace {

constexpr int kSteps = 3;
constexpr int64_t kBatch = 11;  // uneven micro-batches for M = 2, 3, 4 and 8

using OptFactory = std::function<std::unique_ptr<nn::optim::Optimizer>(std::vector<Tensor>)>;

OptFactory sgd() {
  return [](std::vector<Tensor> ps) {
    return std::make_unique<nn::optim::SGD>(std::move(ps), 0.1, 0.9);
  };
}
OptFactory adam() {
  return
      [](std::vector<Tensor> ps) { return std::make_unique<nn::optim::Adam>(std::move(ps), 1e-3); };
}

std::shared_ptr<nn::SequentialImpl> make_lenet() {
  Generator gen(21);
  return nn::models::lenet({nn::models::LeNetActivation::ReLU, 10}, gen);
}

std::vector<std::pair<Tensor, Tensor>> batches() {
  Generator gen(22);
  std::vector<std::pair<Tensor, Tensor>> out;
  for (int i = 0; i < kSteps; ++i) out.push_back(test::random_batch(kBatch, {1, 28, 28}, 10, gen));
  return out;
}

LossFn ce() {
  return [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y); };
}

struct Run {
  std::shared_ptr<nn::SequentialImpl> model;
  std::vector<double> losses;
};

Run train_one_device(const OptFactory& make_opt) {
  Run r{make_lenet(), {}};
  auto opt = make_opt(r.model->parameters());
  for (const auto& [x, y] : batches()) {
    opt->zero_grad();
    Tensor loss = cross_entropy(r.model->forward(x), y);
    loss.backward();
    opt->step();
    r.losses.push_back(loss.item());
  }
  return r;
}

Run train_pipeline(const std::vector<int64_t>& balance, const Schedule& schedule,
                   const OptFactory& make_opt, std::vector<StageStats>* stats = nullptr) {
  Run r{make_lenet(), {}};
  Pipeline pipe(split_by_balance(*r.model, balance, cpu_devices(static_cast<int>(balance.size()))),
                schedule, ce());
  auto opt = make_opt(r.model->parameters());
  for (const auto& [x, y] : batches()) {
    opt->zero_grad();
    std::vector<Tensor> per_micro_batch;
    r.losses.push_back(pipe.step(x, y, &per_micro_batch).item());
    REQUIRE(per_micro_batch.size() == static_cast<size_t>(schedule.num_micro_batches));
    opt->step();
  }
  if (stats != nullptr) *stats = pipe.stats();
  return r;
}

}  // namespace

TEST_CASE("pipeline: model parallel and GPipe and 1F1B equal one-device training",
          "[parallel][pipeline]") {
  const std::vector<std::pair<const char*, OptFactory>> optimizers = {{"SGD momentum", sgd()},
                                                                      {"Adam", adam()}};
  for (const auto& [opt_name, make_opt] : optimizers) {
    const Run one = train_one_device(make_opt);
    CHECK(test::max_param_error(*one.model, *make_lenet()) >
          1e-3);       // the steps moved the parameters
    double worst = 0;  // the steps moved the parameters
    for (const std::vector<int64_t>& balance :
         {std::vector<int64_t>{7, 5}, std::vector<int64_t>{3, 3, 3, 3}}) {
      const int P = static_cast<int>(balance.size());
      for (int M : {1, 2, 3, 4, 8}) {
        for (const char* kind : {"gpipe", "1f1b"}) {
          const Schedule schedule = schedule_by_name(kind, P, M);
          std::vector<StageStats> stats;
          const Run run = train_pipeline(balance, schedule, make_opt, &stats);
          const double err = test::max_param_error(*run.model, *one.model);
          INFO(opt_name << ", " << P << " stages, " << schedule.name << ", M " << M
                        << ": max rel error " << err);
          // M = 1 runs the one-device kernels, but each stage on its own worker thread, where
          // OpenBLAS may split a product differently: equal to within a rounding, not bitwise.
          CHECK(err <= (M == 1 ? 1e-6 : 1e-5));
          worst = std::max(worst, err);
          for (int k = 0; k < kSteps; ++k)
            CHECK(std::abs(run.losses[k] - one.losses[k]) <= 1e-5 * one.losses[k]);
          // What each stage held at once is what the schedule says (Note [1F1B in-flight bound]).
          for (int s = 0; s < P; ++s) {
            CHECK(stats[s].max_in_flight == max_in_flight(schedule, s));
            CHECK(stats[s].max_in_flight == (schedule.name == "1F1B" ? std::min(P - s, M) : M));
          }
        }
      }
    }
    std::printf("pipeline vs one device, %s, %d steps: max rel error %.3g\n", opt_name, kSteps,
                worst);
  }
}

TEST_CASE("pipeline: a split by measured time trains to one device's parameters",
          "[parallel][pipeline]") {
  // Whatever balance the machine's timings give, the stages hold the model's layers in order:
  // the same numbers as one device, as for the fixed balances above.
  const Run one = train_one_device(sgd());
  Generator gen(24);
  const Tensor sample = randn({micro_batch_sizes(kBatch, 4)[0], 1, 28, 28}, kFloat32, kCPU, &gen);
  for (int P : {2, 3, 4}) {
    const auto balance = balance_by_time(*make_lenet(), sample, P, 3);
    INFO(P << " stages, balance by time " << balance_str(balance));
    REQUIRE(balance.size() == static_cast<size_t>(P));
    int64_t layers = 0;
    for (int64_t n : balance) {
      CHECK(n >= 1);
      layers += n;
    }
    CHECK(layers == 12);
    const Run run = train_pipeline(balance, schedule_1f1b(P, 4), sgd());
    CHECK(test::max_param_error(*run.model, *one.model) <= 1e-5);
    for (int k = 0; k < kSteps; ++k)
      CHECK(std::abs(run.losses[k] - one.losses[k]) <= 1e-5 * one.losses[k]);
  }
}

TEST_CASE("pipeline: 1F1B holds fewer activations than GPipe (measured)", "[parallel][pipeline]") {
  // The allocator's peak above what was live before one step, LeNet, batch 128, 4 stages,
  // M = 8. On virtual CPU devices the counter is the process's, so it is the four stages
  // together. GPipe holds all 8 micro-batches' activations, 1F1B at most 4 on stage 0 (measured
  // with batch 256: 11.2 MB and 6.0 MB, docs/11-pipelines.md).
  Generator gen(51);
  auto [x, y] = test::random_batch(128, {1, 28, 28}, 10, gen);
  std::vector<size_t> peak;
  for (const char* kind : {"gpipe", "1f1b"}) {
    auto model = make_lenet();
    Pipeline pipe(split_by_balance(*model, {3, 3, 3, 3}, cpu_devices(4)),
                  schedule_by_name(kind, 4, 8), ce());
    pipe.step(x, y);  // gradients allocated, as in every later step
    const size_t before = allocated_bytes(kCPU);
    reset_max_allocated_bytes(kCPU);
    pipe.step(x, y);
    peak.push_back(max_allocated_bytes(kCPU) - before);
  }
  std::printf("peak above start, LeNet batch 128, P 4, M 8: GPipe %.2f MB, 1F1B %.2f MB\n",
              peak[0] / 1e6, peak[1] / 1e6);
  CHECK(peak[1] < peak[0] * 3 / 4);
}

TEST_CASE("pipeline: BatchNorm normalizes each micro-batch by its own statistics",
          "[parallel][pipeline]") {
  // Conv2d -> BatchNorm2d -> ReLU | Flatten -> Linear, 2 stages: M = 1 is one-device training;
  // M = 2 normalizes each half of the batch by its own mean and variance, so it differs, and
  // the running statistics are updated once per micro-batch (num_batches_tracked counts M).
  auto make = [] {
    Generator gen(41);
    return std::make_shared<nn::SequentialImpl>(std::initializer_list<std::shared_ptr<nn::Module>>{
        std::make_shared<nn::Conv2d>(1, 4, 3, 1, 1, true, gen),
        std::make_shared<nn::BatchNorm2d>(4), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(4 * 6 * 6, 3, true, gen)});
  };
  Generator gen(42);
  auto [x, y] = test::random_batch(8, {1, 6, 6}, 3, gen);
  auto one = make();
  nn::optim::SGD opt_one(one->parameters(), 0.1);
  cross_entropy(one->forward(x), y).backward();
  opt_one.step();
  for (int M : {1, 2}) {
    auto model = make();
    Pipeline pipe(split_by_balance(*model, {3, 2}, cpu_devices(2)), schedule_1f1b(2, M), ce());
    nn::optim::SGD opt(model->parameters(), 0.1);
    pipe.step(x, y);
    opt.step();
    const auto& bn = model->at<nn::BatchNorm2d>(1);
    INFO("M " << M);
    CHECK(bn.num_batches_tracked().item() == M);
    if (M == 1) {
      CHECK(test::max_param_error(*model, *one) == 0.0);
    } else {
      CHECK(test::max_param_error(*model, *one) > 1e-4);
    }
  }
}

TEST_CASE("pipeline: a stage's failure names it and stops the others at once",
          "[parallel][pipeline]") {
  auto model = make_lenet();
  PipelineOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  Pipeline pipe(split_by_balance(*model, {3, 3, 3, 3}, cpu_devices(4)), schedule_1f1b(4, 4), ce(),
                options);
  Generator gen(3);
  auto [x, y] = test::random_batch(8, {1, 28, 28}, 10, gen);
  Tensor bad_labels = full({8}, 12.0, kInt64);  // class 12 of 10: the last stage's loss throws
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg =
      test::error_message<ValueError>([&] { pipe.step(x, bad_labels); });  // its own type
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(test::contains(msg, "pipeline stage 3 (cpu:3) at F0: "));
  CHECK(seconds < 5.0);  // aborted, not timed out
  // The pipeline is usable again afterwards.
  CHECK(std::isfinite(pipe.step(x, y).item()));

  // A neighbour that never sends: the receive gives up after its timeout.
  LocalBoundary boundary(2, std::chrono::milliseconds(50));
  CHECK(test::contains(
      test::error_message<TimeoutError>([&] { boundary.recv_activation(1, 0, Device::cpu(1)); }),
      "pipeline: stage 1 waited 50 ms for the activation of micro-batch 0 from stage 0"));
  CHECK(test::contains(
      test::error_message<TimeoutError>([&] { boundary.recv_grad(0, 2, Device::cpu(0)); }),
      "pipeline: stage 0 waited 50 ms for the gradient of micro-batch 2 from stage 1"));
  boundary.send_activation(0, 0, ones({2}));
  CHECK(boundary.pending() == 1);
  CHECK(test::rel_error(boundary.recv_activation(1, 0, Device::cpu(1)), ones({2})) == 0.0);
  CHECK(boundary.pending() == 0);
}

TEST_CASE("pipeline: bad input is a clear error", "[parallel][pipeline]") {
  auto model = make_lenet();
  auto stages = split_by_balance(*model, {6, 6}, cpu_devices(2));
  CHECK(test::contains(
      test::error_message<ValueError>([&] { Pipeline(stages, schedule_gpipe(3, 2), ce()); }),
      "schedule GPipe is for 3 stages but there are 2"));
  Pipeline pipe(stages, schedule_gpipe(2, 4), ce());
  Generator gen(4);
  auto [x, y] = test::random_batch(3, {1, 28, 28}, 10, gen);
  CHECK(test::contains(test::error_message<ValueError>([&] { pipe.step(x, y); }),
                       "4 micro-batches for a batch of 3 rows"));
  CHECK(test::contains(test::error_message<ShapeError>([&] { pipe.step(x, y.slice(0, 0, 2)); }),
                       "differ in rows"));
  {
    NoGradGuard no_grad;
    CHECK(test::contains(test::error_message<ValueError>([&] { pipe.step(x, y); }),
                         "needs grad mode"));
    CHECK(pipe.forward(x).device() == Device::cpu(1));  // evaluation runs stage after stage
  }
}

TEST_CASE("pipeline: one trace span per action on each stage's device", "[parallel][pipeline]") {
  auto model = make_lenet();
  const auto devices = cpu_devices(2);
  Pipeline pipe(split_by_balance(*model, {6, 6}, devices), schedule_1f1b(2, 3), ce());
  Trace trace(devices);
  pipe.set_trace(&trace);
  Generator gen(5);
  auto [x, y] = test::random_batch(6, {1, 28, 28}, 10, gen);
  pipe.step(x, y);
  CHECK(trace.size() == 2 * 2 * 3);
  CHECK(test::contains(trace.json(), "\"F2\""));
}

TEST_CASE("pipeline on two GPUs equals one-device training", "[parallel][pipeline][cuda]") {
  if (!test::have_two_gpus()) return;
  const Run one = train_one_device(sgd());
  for (const char* kind : {"gpipe", "1f1b"}) {
    Run r{make_lenet(), {}};
    const auto stages = split_by_balance(*r.model, {7, 5}, cuda_devices(2));
    Pipeline pipe(stages, schedule_by_name(kind, 2, 4), ce());
    auto opt = sgd()(r.model->parameters());
    for (const auto& [x, y] : batches()) {
      opt->zero_grad();
      pipe.step(x, y);
      opt->step();
    }
    INFO(kind);
    CHECK(test::max_param_error(*r.model, *one.model) <= 1e-4);  // cuDNN and cuBLAS vs the CPU
    for (const StageStats& st : pipe.stats()) CHECK(st.peak_bytes > 0);
  }
}
