// CUDA backward against the CPU reference: the same graphs, the same float32 inputs.
#include <functional>

#include "autograd/ops.h"
#include "catch.h"
#include "core/generator.h"
#include "helpers.h"

using namespace tandem;
using tandem::test::rel_error;

namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&, Device)>;

// Runs fn on CPU leaves and on CUDA copies of them, backpropagates the same random grad_output
// through both, and compares outputs and every input's gradient.
void check_cpu_vs_cuda(const Fn& fn, const std::vector<Shape>& shapes, double tol = 1e-4) {
  const Device gpu = Device::cuda(0);
  std::vector<Tensor> xc, xg;
  for (const Shape& s : shapes) {
    Tensor c = randn(s);
    Tensor g = c.to(gpu);
    c.set_requires_grad();
    g.set_requires_grad();
    xc.push_back(c);
    xg.push_back(g);
  }
  Tensor yc = fn(xc, kCPU), yg = fn(xg, gpu);
  REQUIRE(yg.device() == gpu);
  REQUIRE(rel_error(yg, yc) < tol);
  Tensor go = randn(yc.shape());
  yc.backward(go);
  yg.backward(go.to(gpu));
  for (size_t i = 0; i < shapes.size(); ++i) {
    INFO("input " << i << " " << shape_str(shapes[i]));
    REQUIRE(xg[i].grad().defined());
    REQUIRE(xg[i].grad().device() == gpu);
    REQUIRE(rel_error(xg[i].grad(), xc[i].grad()) < tol);
  }
}

}  // namespace

TEST_CASE("CUDA backward matches CPU: elementwise and reductions", "[autograd][cuda]") {
  TANDEM_REQUIRE_CUDA();
  manual_seed(41);
  check_cpu_vs_cuda(
      [](const std::vector<Tensor>& x, Device) {
        Tensor t = sigmoid(x[0] * x[1] + x[2]) / (exp(tanh(x[0])) + 1.0);
        return relu(t - 0.3) + sqrt(pow(x[0], 2.0) + 1.0) - log(x[1] * x[1] + 1.0);
      },
      {{4, 5}, {5}, {4, 1}});
  check_cpu_vs_cuda(
      [](const std::vector<Tensor>& x, Device) {
        return sum(x[0], {0, 2}) + mean(x[0], {1, 2}) * max(x[0], {0, 2});
      },
      {{3, 3, 4}});
}

TEST_CASE("CUDA backward matches CPU: shape ops", "[autograd][cuda]") {
  TANDEM_REQUIRE_CUDA();
  manual_seed(42);
  check_cpu_vs_cuda(
      [](const std::vector<Tensor>& x, Device d) {
        Tensor idx = from_vector<int64_t>({3, 0, 3, 1}, {4}, d);
        Tensor t = cat({transpose(x[0], 0, 1), slice(x[1], 1, 1, 3)}, 1);  // [4, 5]
        return reshape(index_select(t, idx), {2, 10}) * 2.0;
      },
      {{3, 4}, {4, 4}});
}

TEST_CASE("CUDA backward matches CPU: a small conv net", "[autograd][cuda]") {
  TANDEM_REQUIRE_CUDA();
  manual_seed(43);
  check_cpu_vs_cuda(
      [](const std::vector<Tensor>& x, Device d) {
        Tensor rm = zeros({4}, kFloat32, d), rv = ones({4}, kFloat32, d);
        Tensor h = conv2d(x[0], x[1], x[2], Conv2dParams{2, 2, 1, 1});  // [2, 4, 4, 4]
        h = relu(batch_norm(h, x[3], x[4], rm, rv, true, 0.1, 1e-5));
        h = avg_pool2d(max_pool2d(h, {2, 2, 1, 1, 0, 0}), {2, 2, 1, 1, 0, 0});  // [2, 4, 2, 2]
        Tensor logits = linear(flatten(h), x[5], x[6]);                         // [2, 3]
        Tensor target = from_vector<int64_t>({2, 0}, {2}, d);
        return cross_entropy(logits, target) + mean(log_softmax(logits));
      },
      {{2, 3, 8, 8}, {4, 3, 3, 3}, {4}, {4}, {4}, {3, 16}, {3}});
}

TEST_CASE("to_device backward returns the gradient to the source device", "[autograd][cuda]") {
  TANDEM_REQUIRE_CUDA();
  Tensor x = from_vector<float>({1.0f, -2.0f, 3.0f}, {3});
  x.set_requires_grad();
  Tensor y = to_device(exp(to_device(x, Device::cuda(0)) * 2.0), kCPU);
  sum(y).backward();
  REQUIRE(x.grad().device() == kCPU);
  auto g = x.grad().to_vector<float>();
  REQUIRE(g[1] == Approx(2.0 * std::exp(-4.0)).epsilon(1e-5));
}

#ifdef TANDEM_WITH_CUDA
#include <cuda_runtime.h>

#include "core/stream.h"

// Invariant 3: backward only enqueues work. Capturing it into a CUDA graph proves it: any host
// synchronization (or pageable copy) during capture invalidates the capture.
TEST_CASE("CUDA backward enqueues work only: it captures into a CUDA graph", "[autograd][cuda]") {
  TANDEM_REQUIRE_CUDA();
  manual_seed(44);
  const Device gpu = Device::cuda(0);
  DeviceGuard device(gpu);
  auto param = [&](const Shape& s) {
    Tensor t = randn(s, kFloat32, gpu);
    t.set_requires_grad();
    return t;
  };
  Tensor w = param({4, 3, 3, 3}), b = param({4}), gamma = param({4}), beta = param({4});
  Tensor fw = param({3, 16}), fb = param({3});
  Tensor x = randn({2, 3, 8, 8}, kFloat32, gpu);
  Tensor target = from_vector<int64_t>({2, 0}, {2}, gpu);
  Tensor rm = zeros({4}, kFloat32, gpu), rv = ones({4}, kFloat32, gpu);
  auto loss_fn = [&] {
    Tensor h = conv2d(x, w, b, Conv2dParams{2, 2, 1, 1});
    h = relu(batch_norm(h, gamma, beta, rm, rv, true, 0.1, 1e-5));
    h = avg_pool2d(max_pool2d(h, {2, 2, 1, 1, 0, 0}), {2, 2, 1, 1, 0, 0});
    return cross_entropy(linear(flatten(h), fw, fb), target);
  };
  // Warm-up outside the capture: library handles, workspaces, and the first .grad buffers.
  loss_fn().backward();
  const std::vector<double> first = tandem::test::values(w.grad());
  Tensor loss = loss_fn();
  synchronize(gpu);

  auto stream = static_cast<cudaStream_t>(current_stream(gpu).handle());
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  std::string error;
  try {
    loss.backward(Tensor(), /*retain_graph=*/true);
  } catch (const std::exception& e) {
    error = e.what();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  INFO(error);
  INFO(cudaGetErrorString(end));
  REQUIRE(error.empty());
  REQUIRE(end == cudaSuccess);

  // Replaying the captured backward accumulates the same gradient once more.
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  const std::vector<double> after = tandem::test::values(w.grad());
  for (size_t i = 0; i < first.size(); ++i) REQUIRE(after[i] == Approx(2 * first[i]).margin(1e-6));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}
#endif
