// Differentiable elementwise ops (broadcasting ones reduce their gradient with sum_to).
#include "autograd/function.h"
#include "autograd/ops.h"

namespace tandem {

using autograd::needs_grad;
using autograd::record;
using autograd::saved;
using autograd::TensorList;

namespace {

// Gradient of a broadcast input: g summed down to the input's shape, or undefined.
Tensor reduce_to(bool needed, const Tensor& g, const Shape& shape) {
  return needed ? kernels::sum_to(g, shape) : Tensor();
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor y = kernels::binary(BinaryOp::Add, a, b);
  if (autograd::any_requires_grad({&a, &b})) {
    record("Add", {a, b}, {y},
           [sa = a.shape(), sb = b.shape(), na = needs_grad(a),
            nb = needs_grad(b)](TensorList&& g) -> TensorList {
             return {reduce_to(na, g[0], sa), reduce_to(nb, g[0], sb)};
           });
  }
  return y;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor y = kernels::binary(BinaryOp::Sub, a, b);
  if (autograd::any_requires_grad({&a, &b})) {
    record("Sub", {a, b}, {y},
           [sa = a.shape(), sb = b.shape(), na = needs_grad(a),
            nb = needs_grad(b)](TensorList&& g) -> TensorList {
             Tensor gb = nb ? kernels::unary(UnaryOp::Neg, kernels::sum_to(g[0], sb)) : Tensor();
             return {reduce_to(na, g[0], sa), gb};
           });
  }
  return y;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor y = kernels::binary(BinaryOp::Mul, a, b);
  if (autograd::any_requires_grad({&a, &b})) {
    const bool na = needs_grad(a), nb = needs_grad(b);
    record(
        "Mul", {a, b}, {y},
        [sa = a.shape(), sb = b.shape(), na, nb, a = nb ? saved(a) : Tensor(),
         b = na ? saved(b) : Tensor()](TensorList&& g) -> TensorList {
          Tensor ga = na ? kernels::sum_to(kernels::binary(BinaryOp::Mul, g[0], b), sa) : Tensor();
          Tensor gb = nb ? kernels::sum_to(kernels::binary(BinaryOp::Mul, g[0], a), sb) : Tensor();
          return {ga, gb};
        });
  }
  return y;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor y = kernels::binary(BinaryOp::Div, a, b);
  if (autograd::any_requires_grad({&a, &b})) {
    const bool na = needs_grad(a), nb = needs_grad(b);
    // d(a/b)/db = -(a/b)/b = -y/b: saves y instead of a.
    record(
        "Div", {a, b}, {y},
        [sa = a.shape(), sb = b.shape(), na, nb, b = saved(b),
         y = nb ? saved(y) : Tensor()](TensorList&& g) -> TensorList {
          Tensor ga = na ? kernels::sum_to(kernels::binary(BinaryOp::Div, g[0], b), sa) : Tensor();
          Tensor gb;
          if (nb) {
            Tensor t = kernels::binary(BinaryOp::Div, kernels::binary(BinaryOp::Mul, g[0], y), b);
            gb = kernels::unary(UnaryOp::Neg, kernels::sum_to(t, sb));
          }
          return {ga, gb};
        });
  }
  return y;
}

Tensor add(const Tensor& a, double s) {
  Tensor y = kernels::scalar(ScalarOp::Add, a, s);
  if (autograd::any_requires_grad({&a})) {
    record("AddScalar", {a}, {y}, [](TensorList&& g) -> TensorList { return {g[0]}; });
  }
  return y;
}

Tensor mul(const Tensor& a, double s) {
  Tensor y = kernels::scalar(ScalarOp::Mul, a, s);
  if (autograd::any_requires_grad({&a})) {
    record("MulScalar", {a}, {y},
           [s](TensorList&& g) -> TensorList { return {kernels::scalar(ScalarOp::Mul, g[0], s)}; });
  }
  return y;
}

Tensor pow(const Tensor& a, double exponent) {
  Tensor y = kernels::scalar(ScalarOp::Pow, a, exponent);
  if (autograd::any_requires_grad({&a})) {
    record("Pow", {a}, {y}, [a = saved(a), e = exponent](TensorList&& g) -> TensorList {
      if (e == 0.0) return {kernels::scalar(ScalarOp::Mul, g[0], 0.0)};
      if (e == 1.0) return {g[0]};
      // e * a^(e-1); for e == 2 skip the pow (and its 0^x corner cases).
      Tensor d = e == 2.0 ? a : kernels::scalar(ScalarOp::Pow, a, e - 1.0);
      return {kernels::scalar(ScalarOp::Mul, kernels::binary(BinaryOp::Mul, g[0], d), e)};
    });
  }
  return y;
}

Tensor neg(const Tensor& x) {
  Tensor y = kernels::unary(UnaryOp::Neg, x);
  if (autograd::any_requires_grad({&x})) {
    record("Neg", {x}, {y},
           [](TensorList&& g) -> TensorList { return {kernels::unary(UnaryOp::Neg, g[0])}; });
  }
  return y;
}

Tensor exp(const Tensor& x) {
  Tensor y = kernels::unary(UnaryOp::Exp, x);
  if (autograd::any_requires_grad({&x})) {
    record("Exp", {x}, {y}, [y = saved(y)](TensorList&& g) -> TensorList {
      return {kernels::binary(BinaryOp::Mul, g[0], y)};
    });
  }
  return y;
}

Tensor log(const Tensor& x) {
  Tensor y = kernels::unary(UnaryOp::Log, x);
  if (autograd::any_requires_grad({&x})) {
    record("Log", {x}, {y}, [x = saved(x)](TensorList&& g) -> TensorList {
      return {kernels::binary(BinaryOp::Div, g[0], x)};
    });
  }
  return y;
}

Tensor sqrt(const Tensor& x) {
  Tensor y = kernels::unary(UnaryOp::Sqrt, x);
  if (autograd::any_requires_grad({&x})) {
    record("Sqrt", {x}, {y}, [y = saved(y)](TensorList&& g) -> TensorList {
      return {kernels::scalar(ScalarOp::Mul, kernels::binary(BinaryOp::Div, g[0], y), 0.5)};
    });
  }
  return y;
}

Tensor sigmoid(const Tensor& x) {
  Tensor y = kernels::unary(UnaryOp::Sigmoid, x);
  if (autograd::any_requires_grad({&x})) {
    record("Sigmoid", {x}, {y}, [y = saved(y)](TensorList&& g) -> TensorList {
      return {kernels::binary(BinaryOp::SigmoidBackward, g[0], y)};
    });
  }
  return y;
}

// ReLU keeps its output for the backward (y > 0 exactly where x > 0), as PyTorch does: the
// next layer keeps that tensor anyway, while the input (a batch-norm output) would be one more
// activation alive until the backward.
Tensor relu(const Tensor& x) {
  Tensor y = kernels::unary(UnaryOp::Relu, x);
  if (autograd::any_requires_grad({&x})) {
    record("Relu", {x}, {y}, [y = saved(y)](TensorList&& g) -> TensorList {
      return {kernels::binary(BinaryOp::ReluBackward, g[0], y)};
    });
  }
  return y;
}

Tensor add_relu(const Tensor& a, const Tensor& b) {
  Tensor y = kernels::binary(BinaryOp::AddRelu, a, b);
  if (autograd::any_requires_grad({&a, &b})) {
    record("AddRelu", {a, b}, {y},
           [sa = a.shape(), sb = b.shape(), na = needs_grad(a), nb = needs_grad(b),
            y = saved(y)](TensorList&& g) -> TensorList {
             const Tensor gs = kernels::binary(BinaryOp::ReluBackward, g[0], y);
             return {reduce_to(na, gs, sa), reduce_to(nb, gs, sb)};
           });
  }
  return y;
}

Tensor tanh(const Tensor& x) {
  Tensor y = kernels::unary(UnaryOp::Tanh, x);
  if (autograd::any_requires_grad({&x})) {
    record("Tanh", {x}, {y}, [y = saved(y)](TensorList&& g) -> TensorList {
      return {kernels::binary(BinaryOp::TanhBackward, g[0], y)};
    });
  }
  return y;
}

Tensor operator+(const Tensor& a, const Tensor& b) {
  return add(a, b);
}
Tensor operator-(const Tensor& a, const Tensor& b) {
  return sub(a, b);
}
Tensor operator*(const Tensor& a, const Tensor& b) {
  return mul(a, b);
}
Tensor operator/(const Tensor& a, const Tensor& b) {
  return div(a, b);
}
Tensor operator-(const Tensor& x) {
  return neg(x);
}
Tensor operator+(const Tensor& a, double s) {
  return add(a, s);
}
Tensor operator-(const Tensor& a, double s) {
  return add(a, -s);
}
Tensor operator*(const Tensor& a, double s) {
  return mul(a, s);
}
Tensor operator/(const Tensor& a, double s) {
  return mul(a, 1.0 / s);
}
Tensor operator*(double s, const Tensor& a) {
  return mul(a, s);
}

}  // namespace tandem
