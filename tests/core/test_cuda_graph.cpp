// CUDA graphs: a captured step replays the same kernels on the same memory, so graphed
// training gives bit for bit the parameters of eager training; a step that cannot be captured
// or that keeps memory made during the capture is caught, never replayed wrongly.
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "core/cuda_graph.h"
#include "helpers.h"
#include "kernels/ops.h"
#include "nn/nn.h"
#include "parallel/flat_buffer.h"
#include "parallel/replicate.h"

using namespace tandem;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::values;

namespace {

using MakeOptimizer = std::function<std::unique_ptr<nn::optim::Optimizer>(std::vector<Tensor>)>;

std::unique_ptr<nn::optim::Optimizer> sgd_momentum(std::vector<Tensor> params) {
  return std::make_unique<nn::optim::SGD>(
      std::move(params), nn::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-4));
}

// A LeNet training step (by default SGD with momentum and weight decay) as StepGraph wants
// it: gradients zeroed in place rather than set to none, the loss written into a tensor it
// owns. coalesce: the parameters in one buffer and the gradients views of another, as the
// one-device stepper keeps them, so the optimizer takes its flat path.
struct LeNetTraining {
  std::shared_ptr<nn::Module> net;
  std::unique_ptr<nn::optim::Optimizer> opt;
  parallel::FlatBuffer grads;
  Tensor loss;  // [] the last step's loss

  LeNetTraining(const std::shared_ptr<nn::Module>& init, Device d,
                const MakeOptimizer& make = sgd_momentum, bool coalesce = false)
      : net(init->clone()) {
    net->to(d);
    if (coalesce) {
      parallel::try_coalesce(net->parameters());
      grads = parallel::FlatBuffer(net->parameters());
      grads.attach();
    }
    opt = make(net->parameters());
    loss = zeros({}, kFloat32, d);
  }
  void step(const std::vector<Tensor>& in) {
    opt->zero_grad(/*set_to_none=*/false);
    Tensor l = cross_entropy((*net)(in[0]), in[1]);
    l.backward();
    opt->step();
    loss.copy_(l.detach());
  }
};

// Batches of `rows` images (the last one `last_rows`) on d.
std::vector<std::vector<Tensor>> batches(int n, int64_t rows, int64_t last_rows, Device d) {
  Generator gen(7);
  std::vector<std::vector<Tensor>> out;
  for (int i = 0; i < n; ++i) {
    const int64_t r = i == n - 1 ? last_rows : rows;
    Tensor x = randn({r, 1, 28, 28}, kFloat32, kCPU, &gen);
    std::vector<int64_t> labels(static_cast<size_t>(r));
    for (int64_t j = 0; j < r; ++j) labels[static_cast<size_t>(j)] = (j * 7 + i) % 10;
    out.push_back({x.to(d), from_vector<int64_t>(labels, {r}).to(d)});
  }
  return out;
}

}  // namespace

TEST_CASE("CUDAGraph replays captured kernels on new input values", "[core][cuda][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Tensor x = zeros({1000}, kFloat32, gpu);
  Tensor y = zeros({1000}, kFloat32, gpu);
  CUDAGraph g;
  g.capture_begin(gpu);
  {
    Tensor t = x * x;  // made and released inside the capture: a graph allocation
    kernels::axpby_(1.0, t + 1.0, 0.0, y);
  }
  g.capture_end();
  REQUIRE(g.captured());
  CHECK(g.num_nodes() >= 2);
  CHECK(values(y) == std::vector<double>(1000, 0.0));  // capturing ran nothing
  for (double v : {2.0, -3.0}) {
    x.fill_(v);
    g.replay();
    CHECK(values(y) == std::vector<double>(1000, v * v + 1));
  }
  g.reset();
  CHECK_FALSE(g.captured());
  CHECK(contains(error_message<ValueError>([&] { g.replay(); }), "before a successful capture"));
}

TEST_CASE("CUDAGraph refuses a capture that keeps memory allocated during it", "[core][cuda][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Tensor x = ones({64}, kFloat32, gpu);
  Tensor kept;
  CUDAGraph g;
  g.capture_begin(gpu);
  kept = x * 2.0;  // outlives the capture: a replay would write memory the graph frees
  const std::string msg = error_message<Error>([&] { g.capture_end(); });
  CHECK(contains(msg, "256 bytes allocated during the capture"));
  CHECK(contains(msg, "zeroed memory now"));
  CHECK_FALSE(g.captured());
  CHECK(g.unbacked_bytes() == 0);
  // Note [a refused capture's memory]: what the capture left behind is real memory now, zeroed
  // (none of the captured work ran), and usable like any tensor's.
  CHECK(values(kept) == std::vector<double>(64, 0.0));
  kept.fill_(5.0);
  CHECK(values(kept + x) == std::vector<double>(64, 6.0));
  const size_t before = allocated_bytes(gpu);
  kept = Tensor();  // freed as usual
  CHECK(allocated_bytes(gpu) == before - 256);
  CHECK(values(x * 3.0) == std::vector<double>(64, 3.0));  // the stream works as before
}

// A step that makes its state lazily, at its first call -- inside the capture when there is no
// warm-up. Before, the refusal escaped StepGraph and the next step captured again, now on
// the state the refused capture had left on memory that did not exist.
TEST_CASE("StepGraph with state made inside the capture: refused once, eager from then, the state usable",
          "[core][cuda][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Tensor state;  // [4], made by the first step
  StepGraph graph([&](const std::vector<Tensor>& in) {
    if (!state.defined()) state = zeros({4}, kFloat32, gpu);
    kernels::axpby_(1.0, in[0], 1.0, state);
  }, {/*warmup_steps=*/0, /*enabled=*/true});
  for (double v : {1.0, 2.0, 3.0}) graph({full({4}, v, kFloat32, gpu)});
  CHECK(contains(graph.eager_reason(), "could not be captured"));
  CHECK(contains(graph.eager_reason(), "16 bytes allocated during the capture"));
  CHECK(graph.captures() == 0);
  CHECK(graph.replays() == 0);
  CHECK(graph.eager_steps() == 3);
  CHECK(values(state) == std::vector<double>(4, 6.0));  // zeros, then every batch once
}

TEST_CASE("graphed LeNet training equals eager training bit for bit", "[core][cuda][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Generator gen(3);
  auto init = nn::models::lenet({nn::models::LeNetActivation::ReLU}, gen);
  LeNetTraining eager(init, gpu), graphed(init, gpu);
  StepGraph graph([&](const std::vector<Tensor>& in) { graphed.step(in); });
  // Two epochs of 5 batches, the last one smaller each time (run eagerly, graph kept).
  auto data = batches(5, 32, 12, gpu);
  for (int epoch = 0; epoch < 2; ++epoch) {
    for (const auto& b : data) {
      eager.step(b);
      graph(b);
      INFO("epoch " << epoch);
      CHECK(values(graphed.loss) == values(eager.loss));
    }
  }
  CHECK(graph.eager_reason().empty());
  CHECK(graph.captures() == 1);
  CHECK(graph.replays() == 2 + 4);  // epoch 1: batches 2-3 (after 2 warm-up steps); epoch 2: 0-3
  CHECK(graph.eager_steps() == 4);  // the warm-up and the two short batches
  auto pe = eager.net->state_dict(), pg = graphed.net->state_dict();
  for (const auto& [name, t] : pe) {
    INFO(name);
    CHECK(values(pg.at(name)) == values(t));
  }
  // A plain (not capturable) optimizer's learning rate is a kernel argument: invalidate()
  // captures again.
  eager.opt->set_lr(0.01);
  graphed.opt->set_lr(0.01);
  graph.invalidate();
  for (const auto& b : data) {
    eager.step(b);
    graph(b);
  }
  CHECK(graph.captures() == 2);
  for (const auto& [name, t] : eager.net->state_dict()) {
    INFO(name);
    CHECK(values(graphed.net->state_dict().at(name)) == values(t));
  }
}

TEST_CASE("graphed training with a capturable optimizer follows learning-rate changes without capturing again", "[core][cuda][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  // Note [capturable optimizer steps]: the learning rate and Adam's step count live on the GPU,
  // so the replays advance Adam's bias correction and read each new rate. Eager training with
  // the same capturable optimizer runs the same kernels: the results agree bit for bit.
  using namespace nn::optim;
  const std::vector<std::pair<const char*, MakeOptimizer>> makers{
      {"adam", [](std::vector<Tensor> ps) {
         return std::make_unique<Adam>(ps, AdamOptions(2e-3).weight_decay(1e-4).capturable(true));
       }},
      {"adamw", [](std::vector<Tensor> ps) {
         return std::make_unique<AdamW>(ps, AdamWOptions(2e-3).capturable(true));
       }},
      {"sgd momentum", [](std::vector<Tensor> ps) {
         return std::make_unique<SGD>(
             ps, SGDOptions(0.1).momentum(0.9).weight_decay(1e-4).capturable(true));
       }},
  };
  for (const auto& [name, make] : makers) {
    for (bool coalesce : {false, true}) {
      INFO(name << (coalesce ? ", coalesced (the flat step)" : ", per parameter"));
      Generator gen(3);
      auto init = nn::models::lenet({nn::models::LeNetActivation::ReLU}, gen);
      LeNetTraining eager(init, gpu, make, coalesce), graphed(init, gpu, make, coalesce);
      StepGraph graph([&](const std::vector<Tensor>& in) { graphed.step(in); });
      // Three epochs of 5 batches (the last one smaller, run eagerly); a new learning rate
      // before the second and the third, set between replays as a scheduler would.
      auto data = batches(5, 32, 12, gpu);
      for (int epoch = 0; epoch < 3; ++epoch) {
        if (epoch > 0) {
          const double lr = eager.opt->lr() * (epoch == 1 ? 0.1 : 5.0);
          eager.opt->set_lr(lr);
          graphed.opt->set_lr(lr);
        }
        for (const auto& b : data) {
          eager.step(b);
          graph(b);
          INFO("epoch " << epoch);
          CHECK(values(graphed.loss) == values(eager.loss));
        }
      }
      CHECK(graph.eager_reason().empty());
      CHECK(graph.captures() == 1);  // the rate changes did not capture again
      CHECK(graph.replays() == 2 + 4 + 4);
      for (const auto& [pname, t] : eager.net->state_dict()) {
        INFO(pname);
        CHECK(values(graphed.net->state_dict().at(pname)) == values(t));
      }
      if (auto* adam = dynamic_cast<Adam*>(graphed.opt.get())) {
        CHECK(adam->step_count(0) == 15);  // the replays counted on the device
        CHECK(adam->step_count(0) == dynamic_cast<Adam&>(*eager.opt).step_count(0));
      }
    }
  }
}

TEST_CASE("graphed channels-last bfloat16 ResNet training equals eager training bit for bit", "[core][cuda][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Generator gen(5);
  using namespace nn;
  // Batch norm, residual blocks with add_relu, a 1x1 shortcut: the layers of ResNet-18.
  std::shared_ptr<Module> init = std::make_shared<SequentialImpl>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 8, 3, 1, 1, true, gen), std::make_shared<BatchNorm2d>(8),
      std::make_shared<ReLU>(), std::make_shared<Residual>(8, 16, true, 2, gen),
      std::make_shared<Residual>(16, 16, false, 1, gen), std::make_shared<GlobalAvgPool2d>(),
      std::make_shared<Flatten>(), std::make_shared<Linear>(16, 10, true, gen)});
  init->to(MemoryFormat::ChannelsLast);
  LeNetTraining eager(init, gpu), graphed(init, gpu);
  REQUIRE(suggest_memory_format(graphed.net->parameters()[0]) == MemoryFormat::ChannelsLast);
  auto bf16_step = [](LeNetTraining& t, const std::vector<Tensor>& in) {
    AutocastGuard autocast;  // the casts are kernels of the captured step
    t.step(in);
  };
  StepGraph graph([&](const std::vector<Tensor>& in) { bf16_step(graphed, in); });
  auto data = batches(5, 32, 12, gpu);
  for (int epoch = 0; epoch < 2; ++epoch) {
    for (const auto& b : data) {
      bf16_step(eager, b);
      graph(b);
      INFO("epoch " << epoch);
      CHECK(values(graphed.loss) == values(eager.loss));
    }
  }
  CHECK(graph.eager_reason().empty());
  CHECK(graph.captures() == 1);
  CHECK(graph.replays() == 6);
  auto pe = eager.net->state_dict(), pg = graphed.net->state_dict();
  for (const auto& [name, t] : pe) {
    INFO(name);
    CHECK(values(pg.at(name)) == values(t));
  }
}

TEST_CASE("a step that cannot be captured runs eagerly with a reason", "[core][cuda][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Generator gen(4);
  auto init = nn::models::lenet({}, gen);
  LeNetTraining eager(init, gpu), graphed(init, gpu);
  double host_sum = 0;  // reading the loss on the host synchronizes: not capturable
  StepGraph graph([&](const std::vector<Tensor>& in) {
    graphed.step(in);
    host_sum += graphed.loss.item();
  }, {/*warmup_steps=*/1, /*enabled=*/true});
  auto data = batches(4, 16, 16, gpu);
  double eager_sum = 0;
  for (const auto& b : data) {
    eager.step(b);
    eager_sum += eager.loss.item();
    graph(b);
  }
  CHECK(contains(graph.eager_reason(), "could not be captured"));
  CHECK(graph.replays() == 0);
  CHECK(graph.eager_steps() == 4);
  CHECK(host_sum == eager_sum);  // every batch got exactly one step
  for (const auto& [name, t] : eager.net->state_dict()) {
    INFO(name);
    CHECK(values(graphed.net->state_dict().at(name)) == values(t));
  }
}

// A step that gathers rows of a fixed "dataset" by the index it is given and adds their sum
// into a fixed accumulator, both read and written in place by the replays.
TEST_CASE("StepGraph replays with the fixed tensors it was captured with and captures again for others",
          "[core][cuda][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  const Tensor data_a = arange(0, 40, 1, kFloat32).reshape({10, 4}).to(gpu);
  const Tensor data_b = (arange(0, 40, 1, kFloat32).reshape({10, 4}) * 100.0).to(gpu);
  const Tensor sum = zeros({4}, kFloat32, gpu);
  StepGraph graph([](const std::vector<Tensor>& in) {  // index; then data, sum (fixed)
    REQUIRE(in.size() == 3);
    kernels::axpby_(1.0, kernels::sum(kernels::index_select(in[1], in[0]), {0}), 1.0, in[2]);
  }, {/*warmup_steps=*/1, /*enabled=*/true});
  auto index = [&](std::vector<int64_t> rows) {
    const auto n = static_cast<int64_t>(rows.size());
    return from_vector<int64_t>(rows, {n}).to(gpu);
  };
  // What the steps below add up to, computed on the CPU: rows of data * scale.
  std::vector<double> expected(4, 0.0);
  auto add = [&](const std::vector<int64_t>& rows, double scale) {
    for (int64_t r : rows)
      for (int64_t c = 0; c < 4; ++c) expected[static_cast<size_t>(c)] += scale * static_cast<double>(r * 4 + c);
  };
  const std::vector<std::vector<int64_t>> steps = {{0, 1}, {2, 3}, {4, 5}, {9, 8}, {7}};
  for (const auto& rows : steps) {  // warm-up, capture, replays, and a short batch run eagerly
    graph({index(rows)}, {data_a, sum});
    add(rows, 1.0);
  }
  CHECK(graph.captures() == 1);
  CHECK(graph.replays() == 3);
  CHECK(graph.eager_steps() == 2);
  CHECK(values(sum) == expected);
  // Another dataset: captured again (no new warm-up), its rows added, not data_a's.
  graph({index({1, 2})}, {data_b, sum});
  add({1, 2}, 100.0);
  CHECK(graph.captures() == 2);
  CHECK(values(sum) == expected);
  graph({index({3, 3})}, {data_b, sum});  // the same tensors again: a replay
  add({3, 3}, 100.0);
  CHECK(graph.captures() == 2);
  CHECK(graph.replays() == 5);
  // A view of other memory with the same shape is another tensor too.
  const Tensor sum2 = zeros({8}, kFloat32, gpu).slice(0, 4, 8);
  graph({index({0, 9})}, {data_b, sum2});
  CHECK(graph.captures() == 3);
  CHECK(values(sum) == expected);  // untouched
  CHECK(values(sum2) == std::vector<double>{3600, 3800, 4000, 4200});
}

TEST_CASE("StepGraph copies its inputs inside the graph, from wherever each step's input lies", "[core][cuda][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  // The inputs are slices of one epoch-long tensor, as a data loader's batches are; then a
  // strided view and a tensor freed as soon as the step is enqueued.
  const Tensor order = arange(0, 64, 1, kFloat32).to(gpu);
  const Tensor out = zeros({4}, kFloat32, gpu);
  StepGraph graph([](const std::vector<Tensor>& in) { kernels::axpby_(2.0, in[0], 0.0, in[1]); },
                  {/*warmup_steps=*/1, /*enabled=*/true});
  std::vector<double> seen;
  for (int64_t b = 0; b < 6; ++b) {
    graph({order.slice(0, 4 * b, 4 * b + 4)}, {out});
    for (double v : values(out)) seen.push_back(v);
  }
  CHECK(graph.captures() == 1);
  CHECK(graph.copies_inside());
  std::vector<double> expected;
  for (int64_t i = 0; i < 24; ++i) expected.push_back(2.0 * static_cast<double>(i));
  CHECK(seen == expected);
  graph({order.slice(0, 40, 48).reshape({4, 2}).select(1, 0)}, {out});  // strided: packed, then copied
  CHECK(values(out) == std::vector<double>{80, 84, 88, 92});
  graph({from_vector<float>({5, 6, 7, 8}, {4}).to(gpu)}, {out});
  CHECK(values(out) == std::vector<double>{10, 12, 14, 16});
  graph({order.slice(0, 1, 5)}, {out});  // 4 bytes past a 16-byte boundary
  CHECK(values(out) == std::vector<double>{2, 4, 6, 8});
  CHECK(graph.replays() == 8);
  CHECK(graph.captures() == 1);
}

TEST_CASE("StepGraph runs CPU steps eagerly and CUDAGraph needs a CUDA device", "[core][cuda_graph]") {
  int calls = 0;
  StepGraph graph([&](const std::vector<Tensor>& in) {
    ++calls;
    CHECK(in[0].device() == kCPU);
  });
  for (int i = 0; i < 5; ++i) graph({ones({2})});
  CHECK(calls == 5);
  // Fixed tensors come after the inputs, as they are (not copied).
  const Tensor fixed = zeros({3});
  StepGraph with_fixed([&](const std::vector<Tensor>& in) {
    REQUIRE(in.size() == 2);
    CHECK(in[0].numel() == 2);
    CHECK(in[1].raw_data() == fixed.raw_data());
    kernels::axpby_(1.0, ones({3}), 1.0, in[1]);
  });
  for (int i = 0; i < 3; ++i) with_fixed({ones({2})}, {fixed});
  CHECK(values(fixed) == std::vector<double>(3, 3.0));
  CHECK(graph.eager_steps() == 5);
  CHECK(graph.replays() == 0);
  CUDAGraph g;
  CHECK(contains(error_message<DeviceError>([&] { g.capture_begin(kCPU); }), "cpu"));
  CHECK_THROWS_AS(StepGraph([](const std::vector<Tensor>&) {}, {-1, true}), ValueError);
}

namespace {

// A stand-in for CUDAGraph that "captures" CPU work: while it records, the step only notes
// which tensor it would read (as captured kernels keep addresses), and a replay applies what
// the recorded step would do with that tensor's current value. capture_end succeeds, refuses
// the capture for memory kept (an Error, as CUDAGraph's), or fails (a CudaError); after a
// failure it can report memory that never existed.
struct FakeGraph final : CUDAGraph {
  enum class End { Ok, KeepsMemory, Fails };
  End end = End::Ok;
  size_t unbacked = 0;  // reported after a failed capture
  bool recording = false, have = false;
  int begins = 0;
  std::function<void()> on_replay;

  bool can_capture(Device) const override { return true; }
  void capture_begin(Device) override {
    ++begins;
    have = false;
    recording = true;
  }
  void capture_end() override {
    recording = false;
    if (end == End::KeepsMemory)
      TANDEM_THROW(Error, "CUDAGraph: the captured work on cpu left 256 bytes allocated during the capture in use after it");
    if (end == End::Fails) TANDEM_THROW(Cuda, "CUDAGraph: capture on cpu failed");
    have = true;
  }
  void capture_abort() noexcept override { recording = false; }
  void replay() const override {
    TANDEM_CHECK(have, Value, "FakeGraph: replay before a capture");
    on_replay();
  }
  void reset() noexcept override { have = false; }
  bool captured() const override { return have; }
  size_t unbacked_bytes() const override { return end == End::Fails ? unbacked : 0; }
};

// A step that adds its input's value to `applied`, once per step -- by running, or by a replay
// of its recording.
struct CountingStep {
  FakeGraph* fake = nullptr;
  std::vector<double> applied;
  Tensor recorded;  // the input tensor the recording reads
  bool throw_while_recording = false;

  void operator()(const std::vector<Tensor>& in) {
    if (fake->recording) {
      recorded = in[0];
      if (throw_while_recording) TANDEM_THROW(Cuda, "operation not permitted when stream is capturing");
      return;
    }
    applied.push_back(in[0].item());
  }
};

}  // namespace

TEST_CASE("StepGraph with a stand-in capture: warm-up, one capture, replays", "[core][cuda_graph]") {
  auto fake = std::make_unique<FakeGraph>();
  FakeGraph* f = fake.get();
  CountingStep step{f};
  f->on_replay = [&] { step.applied.push_back(step.recorded.item()); };
  StepGraph graph([&](const std::vector<Tensor>& in) { step(in); }, {/*warmup_steps=*/1, true}, std::move(fake));
  for (double v : {1.0, 2.0, 3.0, 4.0}) graph({full({}, v)});
  CHECK(step.applied == std::vector<double>{1, 2, 3, 4});  // every batch exactly once
  CHECK(graph.captures() == 1);
  CHECK(graph.replays() == 3);
  CHECK(graph.eager_steps() == 1);
  CHECK(graph.eager_reason().empty());
}

// Note [a refused capture's memory]: a capture refused because the step kept memory made during
// it turns the graph off for good -- a second capture would find that memory already made
// and be accepted, replaying on it -- and every batch still gets its one (eager) step.
TEST_CASE("StepGraph turns itself off when a capture is refused and runs every step eagerly", "[core][cuda_graph]") {
  for (const auto how : {FakeGraph::End::KeepsMemory, FakeGraph::End::Fails}) {
    INFO((how == FakeGraph::End::KeepsMemory ? "memory kept" : "capture failed"));
    auto fake = std::make_unique<FakeGraph>();
    FakeGraph* f = fake.get();
    f->end = how;
    CountingStep step{f};
    f->on_replay = [&] { step.applied.push_back(step.recorded.item()); };
    StepGraph graph([&](const std::vector<Tensor>& in) { step(in); }, {/*warmup_steps=*/1, true}, std::move(fake));
    for (double v : {1.0, 2.0, 3.0, 4.0, 5.0}) graph({full({}, v)});
    CHECK(step.applied == std::vector<double>{1, 2, 3, 4, 5});
    CHECK(f->begins == 1);  // never captured again
    CHECK(graph.captures() == 0);
    CHECK(graph.replays() == 0);
    CHECK(graph.eager_steps() == 5);
    CHECK_FALSE(graph.replaying());
    CHECK(contains(graph.eager_reason(), "could not be captured"));
    CHECK(contains(graph.eager_reason(), how == FakeGraph::End::KeepsMemory ? "in use" : "failed"));
    CHECK(graph.eager_reason().find('\n') == std::string::npos);  // one line
  }
}

TEST_CASE("StepGraph does not run a step eagerly on memory that a failed capture never made", "[core][cuda_graph]") {
  for (bool during_step : {false, true}) {
    INFO((during_step ? "the step threw while recording" : "capture_end failed"));
    auto fake = std::make_unique<FakeGraph>();
    FakeGraph* f = fake.get();
    f->end = FakeGraph::End::Fails;
    f->unbacked = 512;
    CountingStep step{f};
    step.throw_while_recording = during_step;
    f->on_replay = [&] { step.applied.push_back(step.recorded.item()); };
    StepGraph graph([&](const std::vector<Tensor>& in) { step(in); }, {/*warmup_steps=*/0, true}, std::move(fake));
    const std::string msg = error_message<Error>([&] { graph({full({}, 1.0)}); });
    CHECK(contains(msg, "512 bytes"));
    CHECK(contains(msg, "warm-up"));
    CHECK(step.applied.empty());  // not run on that state
    CHECK(contains(graph.eager_reason(), "could not be captured"));
    CHECK(f->begins == 1);
  }
}
