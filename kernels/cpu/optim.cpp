// Optimizer updates, one fused pass per parameter tensor. The arithmetic follows
// torch.optim.SGD and torch.optim.Adam/AdamW (single-tensor, non-amsgrad) step by step, so a
// run can be compared with PyTorch's.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"

namespace tandem::cpu {

namespace {

// SGD: d = g + wd * p; with momentum, buf = d on the first step, else
// buf = momentum * buf + (1 - dampening) * d; then d = nesterov ? d + momentum * buf : buf;
// finally p -= lr * d.
template <typename T>
void sgd(T* param, const T* grad, T* buf, int64_t n, const SgdParams& p) {
  const T lr = static_cast<T>(p.lr), wd = static_cast<T>(p.weight_decay);
  const T mom = static_cast<T>(p.momentum), damp = static_cast<T>(1.0 - p.dampening);
  const bool use_wd = p.weight_decay != 0.0;
  if (p.momentum == 0.0) {
    for (int64_t i = 0; i < n; ++i) {
      const T d = use_wd ? grad[i] + wd * param[i] : grad[i];
      param[i] -= lr * d;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    T d = use_wd ? grad[i] + wd * param[i] : grad[i];
    const T b = p.first_step ? d : mom * buf[i] + damp * d;
    buf[i] = b;
    d = p.nesterov ? d + mom * b : b;
    param[i] -= lr * d;
  }
}

// Adam: g += wd * p (Adam) or p *= 1 - lr * wd (AdamW); m = b1 m + (1 - b1) g;
// v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
template <typename T>
void adam(T* param, const T* grad, T* m, T* v, int64_t n, const AdamParams& p) {
  const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  const T step_size = static_cast<T>(p.lr / bc1);
  const T inv_bc2_sqrt = static_cast<T>(1.0 / std::sqrt(bc2));
  const T b1 = static_cast<T>(p.beta1), b2 = static_cast<T>(p.beta2);
  const T one_b1 = static_cast<T>(1.0 - p.beta1), one_b2 = static_cast<T>(1.0 - p.beta2);
  const T eps = static_cast<T>(p.eps), wd = static_cast<T>(p.weight_decay);
  const T decay = static_cast<T>(1.0 - p.lr * p.weight_decay);
  const bool use_wd = p.weight_decay != 0.0;
  for (int64_t i = 0; i < n; ++i) {
    T g = grad[i];
    if (use_wd) {
      if (p.decoupled_weight_decay) {
        param[i] *= decay;
      } else {
        g += wd * param[i];
      }
    }
    m[i] = b1 * m[i] + one_b1 * g;
    v[i] = b2 * v[i] + one_b2 * g * g;
    const T denom = std::sqrt(v[i]) * inv_bc2_sqrt + eps;
    param[i] -= step_size * m[i] / denom;
  }
}

}  // namespace

void CpuBackend::sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf,
                          const SgdParams& p) {
  dispatch_floating(param.dtype(), "sgd_step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    sgd<T>(static_cast<T*>(param.raw_data()), static_cast<const T*>(grad.raw_data()),
           momentum_buf.defined() ? static_cast<T*>(momentum_buf.raw_data()) : nullptr,
           param.numel(), p);
  });
}

void CpuBackend::adam_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                           const Tensor& v, const AdamParams& p) {
  dispatch_floating(param.dtype(), "adam_step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    adam<T>(static_cast<T*>(param.raw_data()), static_cast<const T*>(grad.raw_data()),
            static_cast<T*>(m.raw_data()), static_cast<T*>(v.raw_data()), param.numel(), p);
  });
}

}  // namespace tandem::cpu
