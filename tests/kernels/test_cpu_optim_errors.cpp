// CPU optimizer steps against hand-stepped updates, and the dispatcher's argument errors
// (shape, dtype and device mismatches, undefined tensors, a backend without CUDA).
#include <cmath>

#include "tests/kernels/test_cpu_util.h"

using namespace tandem;
using namespace tandem::test;

namespace {

// torch.optim.SGD's update for one element over `grads.size()` steps.
double sgd_ref(double p, const std::vector<double>& grads, const SgdParams& prm) {
  double buf = 0;
  for (size_t s = 0; s < grads.size(); ++s) {
    double d = grads[s] + prm.weight_decay * p;
    if (prm.momentum != 0) {
      buf = s == 0 ? d : prm.momentum * buf + (1 - prm.dampening) * d;
      d = prm.nesterov ? d + prm.momentum * buf : buf;
    }
    p -= prm.lr * d;
  }
  return p;
}

// torch.optim.Adam / AdamW for one element.
double adam_ref(double p, const std::vector<double>& grads, const AdamParams& prm) {
  double m = 0, v = 0;
  for (size_t s = 0; s < grads.size(); ++s) {
    double g = grads[s];
    if (prm.decoupled_weight_decay) {
      p *= 1 - prm.lr * prm.weight_decay;
    } else {
      g += prm.weight_decay * p;
    }
    m = prm.beta1 * m + (1 - prm.beta1) * g;
    v = prm.beta2 * v + (1 - prm.beta2) * g * g;
    const double t = static_cast<double>(s + 1);
    const double mhat = m / (1 - std::pow(prm.beta1, t)), vhat = v / (1 - std::pow(prm.beta2, t));
    p -= prm.lr * mhat / (std::sqrt(vhat) + prm.eps);
  }
  return p;
}

SgdParams sgd(double lr, double momentum, double dampening, double wd, bool nesterov) {
  SgdParams p;
  p.lr = lr, p.momentum = momentum, p.dampening = dampening, p.weight_decay = wd;
  p.nesterov = nesterov;
  return p;
}

AdamParams adam(double lr, double wd, bool decoupled) {
  AdamParams p;
  p.lr = lr, p.beta1 = 0.8, p.beta2 = 0.95, p.eps = 1e-6, p.weight_decay = wd;
  p.decoupled_weight_decay = decoupled;
  return p;
}

}  // namespace

TEST_CASE("cpu sgd_step matches torch.optim.SGD", "[kernels]") {
  const SgdParams cases[] = {sgd(0.1, 0, 0, 0, false), sgd(0.1, 0, 0, 0.01, false),
                             sgd(0.05, 0.9, 0, 0, false), sgd(0.05, 0.9, 0.3, 0.02, false),
                             sgd(0.05, 0.8, 0, 0.01, true)};
  for (DType dt : kFloatTypes) {
    for (const SgdParams& prm : cases) {
      INFO(dtype_name(dt) << " momentum " << prm.momentum << " dampening " << prm.dampening
                          << " wd " << prm.weight_decay << " nesterov " << prm.nesterov);
      Tensor param = rnd({3, 4}, dt);
      Tensor buf = prm.momentum != 0 ? empty({3, 4}, dt) : Tensor();
      const std::vector<double> p0 = values(param);
      std::vector<std::vector<double>> grads(12);
      for (int step = 0; step < 3; ++step) {
        Tensor g = rnd({3, 4}, dt);
        const std::vector<double> gv = values(g);
        for (size_t i = 0; i < 12; ++i) grads[i].push_back(gv[i]);
        SgdParams p = prm;
        p.first_step = step == 0;
        kernels::sgd_step(param, g, buf, p);
      }
      std::vector<double> want;
      for (size_t i = 0; i < 12; ++i) want.push_back(sgd_ref(p0[i], grads[i], prm));
      require_close(param, want, tol(dt) * 10);
    }
  }
}

TEST_CASE("cpu adam_step matches torch.optim.Adam and AdamW", "[kernels]") {
  for (DType dt : kFloatTypes) {
    for (const AdamParams& prm :
         {adam(0.01, 0, false), adam(0.01, 0.1, false), adam(0.01, 0.1, true)}) {
      INFO(dtype_name(dt) << " wd " << prm.weight_decay << " decoupled "
                          << prm.decoupled_weight_decay);
      Tensor param = rnd({7}, dt), m = zeros({7}, dt), v = zeros({7}, dt);
      const std::vector<double> p0 = values(param);
      std::vector<std::vector<double>> grads(7);
      for (int step = 1; step <= 4; ++step) {
        Tensor g = rnd({7}, dt);
        const std::vector<double> gv = values(g);
        for (size_t i = 0; i < 7; ++i) grads[i].push_back(gv[i]);
        AdamParams p = prm;
        p.step = step;
        kernels::adam_step(param, g, m, v, p);
      }
      std::vector<double> want;
      for (size_t i = 0; i < 7; ++i) want.push_back(adam_ref(p0[i], grads[i], prm));
      require_close(param, want, tol(dt) * 50);
    }
  }
}

TEST_CASE("cpu optimizer argument errors", "[kernels]") {
  Tensor param = rnd({4}, kFloat32);
  SgdParams mom = sgd(0.1, 0.9, 0, 0, false);
  REQUIRE_THROWS_AS(kernels::sgd_step(param, rnd({5}, kFloat32), Tensor(), {}), ShapeError);
  REQUIRE_THROWS_AS(kernels::sgd_step(param, rnd({4}, kFloat64), Tensor(), {}), DTypeError);
  REQUIRE_THROWS_AS(kernels::sgd_step(param, rnd({4}, kFloat32), Tensor(), mom), ValueError);
  REQUIRE_THROWS_AS(
      kernels::sgd_step(rnd({4, 2}, kFloat32).transpose(0, 1), rnd({2, 4}, kFloat32), Tensor(), {}),
      ValueError);
  AdamParams a;
  a.step = 0;
  REQUIRE_THROWS_AS(kernels::adam_step(param, rnd({4}, kFloat32), zeros({4}), zeros({4}), a),
                    ValueError);
  REQUIRE_THROWS_AS(kernels::adam_step(param, rnd({4}, kFloat32), zeros({3}), zeros({4}), {}),
                    ShapeError);
}

TEST_CASE("cpu dispatcher rejects mixed devices", "[kernels]") {
  const Device d1 = Device::cpu(1);
  Tensor a = rnd({2, 3}, kFloat32), b = rnd({2, 3}, kFloat32).to(d1);
  REQUIRE(b.device() == d1);
  REQUIRE_THROWS_AS(kernels::binary(BinaryOp::Add, a, b), DeviceError);
  REQUIRE_THROWS_AS(kernels::binary_(BinaryOp::Add, a, b), DeviceError);
  REQUIRE_THROWS_AS(kernels::axpby_(1.0, a, 1.0, b), DeviceError);
  REQUIRE_THROWS_AS(kernels::matmul(a, b, false, true), DeviceError);
  REQUIRE_THROWS_AS(kernels::conv2d(rnd({1, 1, 4, 4}, kFloat32), rnd({1, 1, 3, 3}, kFloat32).to(d1),
                                    Tensor(), {}),
                    DeviceError);
  REQUIRE_THROWS_AS(kernels::cross_entropy(a, from_vector<int64_t>({0, 1}, {2}, d1)), DeviceError);
  REQUIRE_THROWS_AS(kernels::index_select(a, from_vector<int64_t>({0}, {1}, d1)), DeviceError);
  REQUIRE_THROWS_AS(kernels::sgd_step(a, b, Tensor(), {}), DeviceError);
  const std::string msg = error_message([&] { kernels::binary(BinaryOp::Mul, a, b); });
  INFO(msg);
  REQUIRE(msg.find("cpu:0") != std::string::npos);
  REQUIRE(msg.find("cpu:1") != std::string::npos);

  // The same ops work on cpu:1 alone, and their outputs stay there.
  Tensor c = kernels::binary(BinaryOp::Add, b, b);
  REQUIRE(c.device() == d1);
  require_close(c, values(kernels::scalar(ScalarOp::Mul, b, 2.0)), 1e-6);
  REQUIRE(kernels::matmul(b, b, false, true).device() == d1);
}

TEST_CASE("cpu dispatcher rejects mismatched shapes and dtypes", "[kernels]") {
  Tensor a = rnd({2, 3}, kFloat32);
  const std::string msg =
      error_message([&] { kernels::binary(BinaryOp::Add, a, rnd({4}, kFloat32)); });
  INFO(msg);
  REQUIRE(msg.find("add") != std::string::npos);
  REQUIRE(msg.find("[2,3]") != std::string::npos);
  REQUIRE(msg.find("[4]") != std::string::npos);
  REQUIRE_THROWS_AS(kernels::binary(BinaryOp::Add, a, rnd({4}, kFloat32)), ShapeError);
  REQUIRE_THROWS_AS(kernels::binary(BinaryOp::Add, a, rnd({2, 3}, kFloat64)), DTypeError);
  REQUIRE_THROWS_AS(kernels::axpby_(1.0, a, 1.0, rnd({3, 2}, kFloat32)), ShapeError);
  REQUIRE_THROWS_AS(kernels::broadcast_shapes({2, 3}, {3, 2}), ShapeError);
  REQUIRE(kernels::broadcast_shapes({4, 1, 3}, {2, 1}) == Shape{4, 2, 3});
  REQUIRE_THROWS_AS(kernels::unary(UnaryOp::Exp, Tensor()), ValueError);
  REQUIRE_THROWS_AS(kernels::binary(BinaryOp::Add, a, Tensor()), ValueError);
  REQUIRE_THROWS_AS(kernels::log_softmax(rnd({2, 3, 4}, kFloat32)), ShapeError);
  REQUIRE_THROWS_AS(kernels::log_softmax(from_vector<int64_t>({1, 2}, {1, 2})), DTypeError);
}

TEST_CASE("cpu backend map and memcpy", "[kernels]") {
  REQUIRE(&backend_for(kCPU) == &cpu_backend());
  REQUIRE(&backend_for(Device::cpu(3)) == &cpu_backend());
#ifndef TANDEM_WITH_CUDA
  REQUIRE_THROWS_AS(backend_for(Device::cuda(0)), DeviceError);
#endif
  float src[3] = {1, 2, 3}, dst[3] = {0, 0, 0};
  cpu_backend().memcpy(dst, Device::cpu(1), src, kCPU, sizeof(src));
  REQUIRE(dst[2] == 3.0f);
  REQUIRE_THROWS_AS(cpu_backend().memcpy(dst, Device::cuda(0), src, kCPU, sizeof(src)),
                    DeviceError);
}
