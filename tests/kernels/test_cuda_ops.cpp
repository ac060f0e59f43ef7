// CUDA backend vs the CPU reference, part 1: fill, copies, unary/binary/scalar ops, axpby,
// reductions, matmul, copies between devices and work on a non-default stream. Every test runs
// the same kernels:: op on CPU inputs and on CUDA copies of them and compares the results.
#include <array>
#include <cmath>
#include <vector>

#include "catch.h"
#include "core/device.h"
#include "core/stream.h"
#include "helpers.h"
#include "kernels/cuda_test_util.h"
#include "kernels/ops.h"

using namespace tandem;
using namespace tandem::test;

namespace {

const UnaryOp kUnaryOps[] = {UnaryOp::Neg,  UnaryOp::Exp, UnaryOp::Log,  UnaryOp::Sigmoid,
                             UnaryOp::Relu, UnaryOp::Tanh, UnaryOp::Sqrt, UnaryOp::Abs,
                             UnaryOp::Square, UnaryOp::Reciprocal};
const BinaryOp kBinaryOps[] = {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div,
                               BinaryOp::Max, BinaryOp::Min, BinaryOp::Eq, BinaryOp::ReluBackward,
                               BinaryOp::SigmoidBackward, BinaryOp::TanhBackward};

}  // namespace

TEST_CASE("cuda fill and strided copies with dtype conversion", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  for (DType dt : {kFloat32, kFloat64, kInt64, kUInt8}) {
    INFO(dtype_name(dt));
    Tensor c = zeros({9, 11}, dt), g = zeros({9, 11}, dt, kGpu);
    c.slice(1, 2, 7).fill_(3.0);  // strided fill
    g.slice(1, 2, 7).fill_(3.0);
    check_equal(g, c);
    c.fill_(5.0);
    g.fill_(5.0);
    check_equal(g, c);
    c.zero_();
    g.zero_();
    check_equal(g, c);
  }
  Tensor x = uniform({7, 13}, 0.0, 200.0, kFloat32);
  Tensor xg = gpu(x);
  check_equal(xg.transpose(0, 1).contiguous(), x.transpose(0, 1).contiguous());
  check_equal(xg.slice(0, 0, 1).expand({5, 13}).contiguous(),
              x.slice(0, 0, 1).expand({5, 13}).contiguous());
  check_equal(xg.flatten().slice(0, 1, 90).contiguous(), x.flatten().slice(0, 1, 90).contiguous());
  for (DType to : {kFloat64, kInt64, kUInt8, kFloat32}) {
    INFO("to " << dtype_name(to));
    check_equal(xg.to(to), x.to(to));
    check_equal(xg.transpose(0, 1).to(to), x.transpose(0, 1).to(to));
    check_equal(xg.to(to).to(kFloat64), x.to(to).to(kFloat64));
  }
  // A permuted copy into a strided destination.
  Tensor y = zeros({13, 14}, kFloat64), yg = zeros({13, 14}, kFloat64, kGpu);
  y.slice(1, 1, 8).copy_(x.transpose(0, 1));
  yg.slice(1, 1, 8).copy_(xg.transpose(0, 1));
  check_equal(yg, y);
}

TEST_CASE("cuda unary ops", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  for (DType dt : kFloatTypes) {
    for (UnaryOp op : kUnaryOps) {
      INFO(dtype_name(dt) << " op " << static_cast<int>(op));
      const bool positive = op == UnaryOp::Log || op == UnaryOp::Sqrt || op == UnaryOp::Reciprocal;
      Tensor x = positive ? uniform({37, 29}, 0.5, 2.0, dt) : uniform({37, 29}, -3.0, 3.0, dt);
      Tensor xg = gpu(x);
      check(kernels::unary(op, xg), kernels::unary(op, x));
      check(kernels::unary(op, xg.transpose(0, 1)), kernels::unary(op, x.transpose(0, 1)));
      // Contiguous but not 16-byte aligned: the strided kernel handles it.
      check(kernels::unary(op, xg.flatten().slice(0, 1, 1000)),
            kernels::unary(op, x.flatten().slice(0, 1, 1000)));
    }
  }
  Tensor xi = uniform({5, 31}, -50.0, 50.0, kFloat64).to(kInt64);
  for (UnaryOp op : {UnaryOp::Neg, UnaryOp::Relu, UnaryOp::Abs, UnaryOp::Square}) {
    check_equal(kernels::unary(op, gpu(xi)), kernels::unary(op, xi));
  }
  REQUIRE_THROWS_AS(kernels::unary(UnaryOp::Exp, gpu(xi)), DTypeError);
}

TEST_CASE("cuda binary ops with broadcasting", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  for (DType dt : kFloatTypes) {
    for (BinaryOp op : kBinaryOps) {
      INFO(dtype_name(dt) << " op " << static_cast<int>(op));
      Tensor a = uniform({5, 1, 7}, -2.0, 2.0, dt);
      Tensor b = op == BinaryOp::Div ? uniform({3, 1}, 0.5, 2.0, dt) : uniform({3, 1}, -2.0, 2.0, dt);
      check(kernels::binary(op, gpu(a), gpu(b)), kernels::binary(op, a, b));
      Tensor c = uniform({33, 17}, -2.0, 2.0, dt);
      Tensor d = uniform({33, 17}, 0.5, 2.0, dt);
      check(kernels::binary(op, gpu(c), gpu(d)), kernels::binary(op, c, d));
      check(kernels::binary(op, gpu(c).transpose(0, 1), gpu(d).transpose(0, 1)),
            kernels::binary(op, c.transpose(0, 1), d.transpose(0, 1)));
      // In place, with a row broadcast.
      Tensor cg = gpu(c);
      kernels::binary_(op, cg, gpu(d.slice(0, 0, 1)));
      kernels::binary_(op, c, d.slice(0, 0, 1));
      check(cg, c);
    }
  }
  // Integers, with values drawn from a small range so that Eq sees matches.
  Tensor a = uniform({6, 1, 9}, 0.0, 4.0, kFloat64).to(kInt64);
  Tensor b = uniform({5, 9}, 0.0, 4.0, kFloat64).to(kInt64);
  for (BinaryOp op : {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Max, BinaryOp::Min,
                      BinaryOp::Eq}) {
    check_equal(kernels::binary(op, gpu(a), gpu(b)), kernels::binary(op, a, b));
  }
  // NaN propagates through maximum/minimum.
  Tensor n = from_vector<float>({1.0f, NAN, -2.0f}, {3});
  Tensor m = from_vector<float>({NAN, 0.5f, -3.0f}, {3});
  for (BinaryOp op : {BinaryOp::Max, BinaryOp::Min}) {
    std::vector<double> got = tandem::test::values(kernels::binary(op, gpu(n), gpu(m)));
    std::vector<double> want = tandem::test::values(kernels::binary(op, n, m));
    for (size_t i = 0; i < 3; ++i) {
      REQUIRE(std::isnan(got[i]) == std::isnan(want[i]));
      if (!std::isnan(want[i])) REQUIRE(got[i] == want[i]);
    }
  }
}

TEST_CASE("cuda scalar ops and axpby", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    Tensor x = uniform({41, 23}, 0.5, 2.5, dt);
    Tensor xg = gpu(x);
    for (ScalarOp op : {ScalarOp::Add, ScalarOp::Mul, ScalarOp::RSub, ScalarOp::RDiv}) {
      check(kernels::scalar(op, xg, -1.7), kernels::scalar(op, x, -1.7));
      check(kernels::scalar(op, xg.transpose(0, 1), 0.3), kernels::scalar(op, x.transpose(0, 1), 0.3));
    }
    for (double s : {2.0, 1.0, 0.5, -1.0, 1.3, -2.5}) {
      INFO("pow " << s);
      check(kernels::scalar(ScalarOp::Pow, xg, s), kernels::scalar(ScalarOp::Pow, x, s));
    }
    for (auto [alpha, beta] : {std::pair{2.0, 0.0}, {1.0, 1.0}, {0.3, -1.2}}) {
      INFO("alpha " << alpha << " beta " << beta);
      Tensor out = uniform({23, 41}, -1.0, 1.0, dt);
      Tensor outg = gpu(out);
      kernels::axpby_(alpha, x.transpose(0, 1), beta, out);
      kernels::axpby_(alpha, xg.transpose(0, 1), beta, outg);
      check(outg, out);
      // A strided destination.
      Tensor big = uniform({41, 30}, -1.0, 1.0, dt);
      Tensor bigg = gpu(big);
      kernels::axpby_(alpha, x, beta, big.slice(1, 3, 26));
      kernels::axpby_(alpha, xg, beta, bigg.slice(1, 3, 26));
      check(bigg, big);
    }
  }
  Tensor xi = uniform({7, 9}, -20.0, 20.0, kFloat64).to(kInt64);
  for (ScalarOp op : {ScalarOp::Add, ScalarOp::Mul, ScalarOp::RSub}) {
    check_equal(kernels::scalar(op, gpu(xi), 3.0), kernels::scalar(op, xi, 3.0));
  }
}

TEST_CASE("cuda reductions and argmax", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    Tensor x = uniform({37, 1001}, -1.0, 1.0, dt);
    Tensor xg = gpu(x);
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max}) {
      INFO("op " << static_cast<int>(op));
      check(kernels::reduce(op, xg, {1}), kernels::reduce(op, x, {1}));
      check(kernels::reduce(op, xg, {0}, true), kernels::reduce(op, x, {0}, true));
      check(kernels::reduce(op, xg, {}), kernels::reduce(op, x, {}));
      // Few long rows take the two-launch path.
      Tensor y = uniform({3, 70001}, -1.0, 1.0, dt);
      check(kernels::reduce(op, gpu(y), {1}), kernels::reduce(op, y, {1}));
      Tensor z = uniform({3, 5, 7, 11}, -1.0, 1.0, dt);
      check(kernels::reduce(op, gpu(z), {0, 2}), kernels::reduce(op, z, {0, 2}));
      // Many short rows (global average pooling) take the thread-per-row path.
      Tensor p = uniform({40, 9, 4, 4}, -1.0, 1.0, dt);
      check(kernels::reduce(op, gpu(p), {2, 3}), kernels::reduce(op, p, {2, 3}));
      Tensor q = uniform({300, 49}, -1.0, 1.0, dt);
      check(kernels::reduce(op, gpu(q), {1}), kernels::reduce(op, q, {1}));
    }
    check_equal(kernels::argmax(xg, 1), kernels::argmax(x, 1));
    check_equal(kernels::argmax(xg, 0), kernels::argmax(x, 0));
    // Ties: the first maximum wins.
    Tensor t = uniform({64, 9}, 0.0, 3.0, kFloat64).to(kInt64).to(dt);
    check_equal(kernels::argmax(gpu(t), 1), kernels::argmax(t, 1));
  }
  Tensor xi = uniform({13, 17}, -100.0, 100.0, kFloat64).to(kInt64);
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
    check_equal(kernels::reduce(op, gpu(xi), {1}), kernels::reduce(op, xi, {1}));
  }
  // A NaN is the maximum.
  Tensor n = from_vector<float>({1.0f, NAN, 3.0f, 2.0f}, {1, 4});
  REQUIRE(std::isnan(kernels::max(gpu(n), {1}).item()));
  REQUIRE(kernels::argmax(gpu(n), 1).item() == 1.0);
}

TEST_CASE("cuda matmul through cuBLAS", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  // cuBLAS; then tiny outputs with long inner dimensions, which tandem's own small-output
  // kernel computes (Note [small-output products] in kernels/cuda/matmul.cu): a classifier's
  // weight gradient, an inner length that is no multiple of a warp, the size limit exactly.
  const std::array<std::array<int64_t, 3>, 4> shapes{{{37, 53, 29}, {10, 256, 84}, {3, 700, 5}, {64, 64, 32}}};
  for (DType dt : kFloatTypes) {
    for (const auto& [m, k, n] : shapes) {
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          INFO(dtype_name(dt) << " [" << m << ", " << k << "] @ [" << k << ", " << n << "] trans_a " << ta
                              << " trans_b " << tb);
          Tensor a = uniform(ta ? Shape{k, m} : Shape{m, k}, -1.0, 1.0, dt);
          Tensor b = uniform(tb ? Shape{n, k} : Shape{k, n}, -1.0, 1.0, dt);
          Tensor got = kernels::matmul(gpu(a), gpu(b), ta, tb);
          check(got, kernels::matmul(a, b, ta, tb));
          check_equal(kernels::matmul(gpu(a), gpu(b), ta, tb), got.to(kCPU));  // deterministic
        }
      }
      // alpha and beta at the backend level.
      Tensor a = uniform({m, k}, -1.0, 1.0, dt), b = uniform({k, n}, -1.0, 1.0, dt);
      Tensor c = uniform({m, n}, -1.0, 1.0, dt);
      Tensor cg = gpu(c);
      cpu_backend().gemm(false, false, 0.5, a, b, 2.0, c);
      cuda_backend().gemm(false, false, 0.5, gpu(a), gpu(b), 2.0, cg);
      check(cg, c);
    }
    // An empty inner dimension.
    Tensor e = kernels::matmul(zeros({4, 0}, dt, kGpu), zeros({0, 6}, dt, kGpu));
    check_equal(e, zeros({4, 6}, dt));
  }
}

TEST_CASE("cuda copies between devices", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  for (DType dt : {kFloat32, kFloat64, kInt64, kUInt8}) {
    INFO(dtype_name(dt));
    Tensor x = uniform({17, 33}, 0.0, 100.0, kFloat64).to(dt);
    Tensor xg = gpu(x);
    REQUIRE(xg.device() == kGpu);
    check_equal(xg, x);
    check_equal(gpu(xg.to(kCPU)), x);
    check_equal(gpu(xg.transpose(0, 1).to(kCPU)), x.transpose(0, 1).contiguous());
    // Into a strided CPU view, converting dtype on the way.
    Tensor host = zeros({17, 40}, kFloat64);
    host.slice(1, 2, 35).copy_(xg);
    REQUIRE(tandem::test::values(host.slice(1, 2, 35)) == tandem::test::values(x));
    if (cuda_device_count() >= 2) {
      const Device other = Device::cuda(1);
      Tensor y = xg.to(other);
      REQUIRE(y.device() == other);
      REQUIRE(tandem::test::values(y) == tandem::test::values(x));
      check_equal(y.to(kGpu), x);
    }
  }
  // Raw bytes through the backend, both directions.
  std::vector<float> src(1001), back(1001);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) * 0.5f;
  Tensor buf = empty({1001}, kFloat32, kGpu);
  cuda_backend().memcpy(buf.raw_data(), kGpu, src.data(), kCPU, src.size() * sizeof(float));
  cuda_backend().memcpy(back.data(), kCPU, buf.raw_data(), kGpu, back.size() * sizeof(float));
  REQUIRE(back == src);
}

TEST_CASE("cuda ops follow the current stream", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  Tensor a = uniform({65, 31}, -1.0, 1.0, kFloat32), b = uniform({31, 47}, -1.0, 1.0, kFloat32);
  Tensor ag = gpu(a), bg = gpu(b);
  synchronize(kGpu);  // ag, bg were written on the default stream
  Tensor c;
  {
    StreamGuard guard(Stream::create(kGpu));
    c = kernels::unary(UnaryOp::Tanh, kernels::matmul(ag, bg));
    current_stream(kGpu).synchronize();
  }
  check(c, kernels::unary(UnaryOp::Tanh, kernels::matmul(a, b)));
}
