// bfloat16 kernels of the CUDA backend against the CPU reference (tests/kernels/
// test_cpu_bfloat16.cpp pins the CPU to float32-then-round). Tolerances, in bfloat16 ulps:
// copies, fills, gathers, exactly rounded float operations (+ - * / sqrt, comparisons) and
// the expressions built from them must be identical: sigmoid/tanh backward (a product of two
// bfloat16 values is exact in float, so nvcc's fma(-y, y, 1) rounds as the CPU's 1 - y * y
// does) and axpby (computed without contraction, Note [bfloat16 axpby without contraction] in
// kernels/cuda/elementwise.cu: with an FMA a sum that cancels to 0 on the CPU came out as a
// float rounding error, thousands of ulps away). Transcendental functions (expf, logf, tanhf,
// powf differ from the CPU's by a float32 ulp or two) and sums in another order may land on
// the other side of a rounding boundary: 1 ulp. gemm and autocast linear (cuBLAS sums in its
// own order on tensor cores) are compared relative to the largest result, within 2^-6 (two
// ulps).
#include <cmath>
#include <utility>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/device.h"
#include "helpers.h"
#include "kernels/backend.h"
#include "kernels/bf16_test_util.h"
#include "kernels/cuda_test_util.h"
#include "kernels/ops.h"
#include "nn/linear.h"

using namespace tandem;
using namespace tandem::test;

TEST_CASE("cuda bfloat16 fill and copies equal the cpu", "[cuda][bf16]") {
  TANDEM_REQUIRE_CUDA();
  Tensor c = zeros({9, 11}, kBFloat16), g = zeros({9, 11}, kBFloat16, kGpu);
  c.slice(1, 2, 7).fill_(0.1);
  g.slice(1, 2, 7).fill_(0.1);
  require_ulps(g, c, 0);
  c.fill_(-3.4e38);
  g.fill_(-3.4e38);
  require_ulps(g, c, 0);
  Tensor x = uniform({13, 7}, -300.0, 300.0, kFloat32);
  set(x, 0, 0, std::nanf(""));
  set(x, 0, 1, std::ldexp(1.0f, -140));  // a subnormal
  const Tensor xg = gpu(x);
  require_ulps(bf16(xg), bf16(x), 0);
  require_ulps(bf16(xg.transpose(0, 1)), bf16(x.transpose(0, 1)), 0);
  require_ulps(bf16(xg.to(kFloat64)), bf16(x.to(kFloat64)), 0);
  // Without the NaN row: NaN to an integer is undefined, and differs between the devices.
  const Tensor xn = x.slice(0, 1, 13), xng = xg.slice(0, 1, 13);
  require_ulps(bf16(xng.to(kInt64)), bf16(xn.to(kInt64)), 0);
  const Tensor h = bf16(x), hg = bf16(xg);
  require_ulps(hg.transpose(0, 1).contiguous(), h.transpose(0, 1).contiguous(), 0);
  check_equal(hg.slice(0, 1, 13).to(kInt64), h.slice(0, 1, 13).to(kInt64));
  check_equal(hg.slice(0, 1, 13).to(kFloat64), h.slice(0, 1, 13).to(kFloat64));
  check_equal(hg.slice(0, 1, 13).to(kFloat32), h.slice(0, 1, 13).to(kFloat32));
}

TEST_CASE("cuda bfloat16 elementwise ops equal the cpu", "[cuda][bf16]") {
  TANDEM_REQUIRE_CUDA();
  Tensor x = rnd_bf16({37, 41}, -4.0, 4.0);
  set(x, 0, 0, NAN);
  set(x, 0, 1, 0.0f);
  const Tensor xg = gpu(x);
  for (UnaryOp op : {UnaryOp::Neg, UnaryOp::Relu, UnaryOp::Abs, UnaryOp::Square, UnaryOp::Sqrt,
                     UnaryOp::Reciprocal}) {
    INFO("exact unary op " << static_cast<int>(op));
    require_ulps(kernels::unary(op, xg), kernels::unary(op, x), 0);
    require_ulps(kernels::unary(op, xg.transpose(0, 1)), kernels::unary(op, x.transpose(0, 1)), 0);
  }
  for (UnaryOp op : {UnaryOp::Exp, UnaryOp::Log, UnaryOp::Sigmoid, UnaryOp::Tanh}) {
    INFO("unary op " << static_cast<int>(op));
    require_ulps(kernels::unary(op, xg), kernels::unary(op, x), 1);
  }
  Tensor a = rnd_bf16({37, 41}, -2.0, 2.0), b = rnd_bf16({37, 41}, 0.25, 3.0);
  // 0.3 * b - 2 * a cancels exactly on the CPU (0.3f * 1.6796875 rounds to 0.50390625); an FMA
  // leaves the rounding error of the product, 2.0e-8 (the H200 failure at element 82).
  set(a, 2, 0, 0.251953125f);
  set(b, 2, 0, 1.6796875f);
  const Tensor row = rnd_bf16({41});
  const Tensor ag = gpu(a), bg = gpu(b), rowg = gpu(row);
  for (BinaryOp op : {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max,
                      BinaryOp::Min, BinaryOp::Eq, BinaryOp::ReluBackward}) {
    INFO("exact binary op " << static_cast<int>(op));
    require_ulps(kernels::binary(op, ag, bg), kernels::binary(op, a, b), 0);
    require_ulps(kernels::binary(op, ag, rowg), kernels::binary(op, a, row), 0);
  }
  for (BinaryOp op : {BinaryOp::SigmoidBackward, BinaryOp::TanhBackward}) {
    INFO("binary op " << static_cast<int>(op));
    require_ulps(kernels::binary(op, ag, bg), kernels::binary(op, a, b), 0);
  }
  const std::pair<ScalarOp, double> scalar_cases[] = {{ScalarOp::Add, 0.1},  {ScalarOp::Mul, 0.1},
                                                      {ScalarOp::RSub, 2.0}, {ScalarOp::RDiv, 0.3},
                                                      {ScalarOp::Pow, 2.0},  {ScalarOp::Pow, 0.5}};
  for (const auto& [op, s] : scalar_cases) {
    INFO("scalar op " << static_cast<int>(op));
    require_ulps(kernels::scalar(op, bg, s), kernels::scalar(op, b, s), 0);
  }
  require_ulps(kernels::scalar(ScalarOp::Pow, bg, 1.7), kernels::scalar(ScalarOp::Pow, b, 1.7), 1);
  const std::pair<double, double> axpby_cases[] = {{0.5, 0.0}, {1.0, 1.0}, {0.3, -2.0}};
  for (const auto& [alpha, beta] : axpby_cases) {
    INFO("axpby alpha " << alpha << " beta " << beta);
    Tensor out = a.clone(), outg = gpu(a);
    kernels::axpby_(alpha, b, beta, out);
    kernels::axpby_(alpha, bg, beta, outg);
    if (beta == -2.0) REQUIRE(bf16_bits(out)[2 * 41] == 0);  // the cancellation above: +0
    require_ulps(outg, out, 0);
  }
}

TEST_CASE("cuda bfloat16 reductions, argmax and gemm equal the cpu", "[cuda][bf16]") {
  TANDEM_REQUIRE_CUDA();
  // Short rows (one thread per row), ordinary rows and one long split row.
  for (const Shape& s : {Shape{300, 16}, Shape{7, 1000}, Shape{2, 70000}}) {
    INFO(shape_str(s));
    const Tensor x = rnd_bf16(s), xg = gpu(x);
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean}) {
      require_ulps(kernels::reduce(op, xg, {1}), kernels::reduce(op, x, {1}), 1);
    }
    require_ulps(kernels::reduce(ReduceOp::Max, xg, {1}), kernels::reduce(ReduceOp::Max, x, {1}),
                 0);
    check_equal(kernels::argmax(xg, 1), kernels::argmax(x, 1));
  }
  Tensor m = full({2, 40}, -INFINITY, kBFloat16);
  set(m, 1, 3, NAN);
  require_ulps(kernels::reduce(ReduceOp::Max, gpu(m), {1}), kernels::reduce(ReduceOp::Max, m, {1}),
               0);

  const Tensor a = rnd_bf16({67, 129}), b = rnd_bf16({129, 45});
  const Tensor cg = kernels::matmul(gpu(a), gpu(b));
  REQUIRE(cg.dtype() == kBFloat16);
  CHECK(rel_error(cg, kernels::matmul(a, b)) <= 1.0 / 64);
  CHECK(rel_error(kernels::matmul(gpu(b), gpu(a), true, true), kernels::matmul(b, a, true, true)) <=
        1.0 / 64);
  Tensor c = rnd_bf16({67, 45}), cg2 = gpu(c);
  cpu_backend().gemm(false, false, 2.0, a, b, 0.5, c);
  cuda_backend().gemm(false, false, 2.0, gpu(a), gpu(b), 0.5, cg2);
  CHECK(rel_error(cg2, c) <= 1.0 / 64);
  // An empty inner dimension.
  check_equal(kernels::matmul(zeros({3, 0}, kBFloat16, kGpu), zeros({0, 4}, kBFloat16, kGpu)),
              zeros({3, 4}, kBFloat16));
}

TEST_CASE("cuda bfloat16 index_select and index_add equal the cpu", "[cuda][bf16]") {
  TANDEM_REQUIRE_CUDA();
  const Tensor x = rnd_bf16({6, 33});
  const Tensor idx = from_vector<int64_t>({5, 0, 3, 3, 1}, {5});
  check_equal(kernels::index_select(gpu(x), gpu(idx)), kernels::index_select(x, idx));
  const Tensor perm = from_vector<int64_t>({2, 0, 5, 1, 4, 3}, {6});  // one add per element: exact
  require_ulps(kernels::index_add(gpu(x), gpu(perm), {6, 33}), kernels::index_add(x, perm, {6, 33}),
               0);
  // Repeated rows go through the compare-and-swap loop (order-dependent rounding).
  const Tensor rep = from_vector<int64_t>({1, 1, 1, 1, 0, 0}, {6});
  CHECK(rel_error(kernels::index_add(gpu(x), gpu(rep), {2, 33}),
                  kernels::index_add(x, rep, {2, 33})) <= 1.0 / 64);
}

TEST_CASE("cuda autocast linear equals the cpu", "[cuda][bf16][autograd]") {
  TANDEM_REQUIRE_CUDA();
  Generator gen(11);
  nn::Linear cpu_fc(64, 24, true, gen);
  nn::Linear gpu_fc(64, 24, true, gen);
  gpu_fc.load_state_dict(cpu_fc.state_dict());
  gpu_fc.to(kGpu);
  const Tensor x = uniform({16, 64}, -1.0, 1.0, kFloat32, kCPU, &gen);
  const Tensor g = rnd_bf16({16, 24});
  Tensor xc = x.clone().set_requires_grad(), xg = gpu(x).set_requires_grad();
  Tensor yc, yg;
  {
    AutocastGuard autocast;
    yc = cpu_fc(xc);
    yg = gpu_fc(xg);
  }
  REQUIRE(yg.dtype() == kBFloat16);
  CHECK(rel_error(yg, yc) <= 1.0 / 64);
  yc.backward(g);
  yg.backward(gpu(g));
  REQUIRE(xg.grad().dtype() == kFloat32);
  REQUIRE(gpu_fc.weight().grad().dtype() == kFloat32);
  CHECK(rel_error(xg.grad(), xc.grad()) <= 1.0 / 64);
  CHECK(rel_error(gpu_fc.weight().grad(), cpu_fc.weight().grad()) <= 1.0 / 64);
  CHECK(rel_error(gpu_fc.bias().grad(), cpu_fc.bias().grad()) <= 1.0 / 64);
}
