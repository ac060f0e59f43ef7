// Optimizer updates, one fused pass per parameter tensor. The arithmetic follows
// torch.optim.SGD and torch.optim.Adam/AdamW (single-tensor, non-amsgrad) step by step, so a
// run can be compared with PyTorch's. A capturable step (Note [capturable optimizer steps] in
// nn/optim/optimizer.h) reads the learning rate and Adam's step constants from memory. With
// copy_into (SgdParams, AdamParams) each new value is also stored cast to the copy's type C,
// converted as the copy kernel converts (static_cast), so the copy is a cast's bits.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/optim_copy.h"

namespace tandem::cpu {

namespace {

using kernels::copy_ptr;
using kernels::dispatch_copy;
using kernels::kCopies;
using kernels::NoCopy;

// SGD: d = g + wd * p; with momentum, buf = d on the first step, else
// buf = momentum * buf + (1 - dampening) * d; then d = nesterov ? d + momentum * buf : buf;
// finally p -= lr * d.
// A capturable step (p.lr_tensor defined) reads the learning rate from memory: the same double,
// cast the same way. copy (C not NoCopy): copy[i] = the new param[i], cast.
template <typename T, typename C>
void sgd(T* param, const T* grad, T* buf, C* copy, int64_t n, const SgdParams& p) {
  const double lr_value = p.lr_tensor.defined() ? *p.lr_tensor.data<double>() : p.lr;
  const T lr = static_cast<T>(lr_value), wd = static_cast<T>(p.weight_decay);
  const T mom = static_cast<T>(p.momentum), damp = static_cast<T>(1.0 - p.dampening);
  const bool use_wd = p.weight_decay != 0.0;
  if (p.momentum == 0.0) {
    for (int64_t i = 0; i < n; ++i) {
      const T d = use_wd ? grad[i] + wd * param[i] : grad[i];
      param[i] -= lr * d;
      if constexpr (kCopies<C>) copy[i] = static_cast<C>(param[i]);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    T d = use_wd ? grad[i] + wd * param[i] : grad[i];
    const T b = p.first_step ? d : mom * buf[i] + damp * d;
    buf[i] = b;
    d = p.nesterov ? d + mom * b : b;
    param[i] -= lr * d;
    if constexpr (kCopies<C>) copy[i] = static_cast<C>(param[i]);
  }
}

// The step-dependent constants of an Adam step, in double: lr / (1 - b1^t), 1 / sqrt(1 - b2^t)
// and 1 - lr * wd. The host path (lr and t kernel arguments) and adam_advance_step (both read
// from memory) share this one function, so a capturable CPU step gives the very same bits.
struct AdamStepConsts {
  double step_size, inv_bc2_sqrt, decay;
};

AdamStepConsts adam_step_consts(double lr, double t, const AdamParams& p) {
  const double bc1 = 1.0 - std::pow(p.beta1, t);
  const double bc2 = 1.0 - std::pow(p.beta2, t);
  return {lr / bc1, 1.0 / std::sqrt(bc2), 1.0 - lr * p.weight_decay};
}

// Adam: g += wd * p (Adam) or p *= 1 - lr * wd (AdamW); m = b1 m + (1 - b1) g;
// v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
// copy (C not NoCopy): copy[i] = the new param[i], cast.
template <typename T, typename C>
void adam(T* param, const T* grad, T* m, T* v, C* copy, int64_t n, const AdamParams& p) {
  AdamStepConsts c;
  if (p.consts.defined()) {
    const double* k = p.consts.data<double>();
    c = {k[0], k[1], k[2]};
  } else {
    c = adam_step_consts(p.lr, static_cast<double>(p.step), p);
  }
  const T step_size = static_cast<T>(c.step_size);
  const T inv_bc2_sqrt = static_cast<T>(c.inv_bc2_sqrt);
  const T b1 = static_cast<T>(p.beta1), b2 = static_cast<T>(p.beta2);
  const T one_b1 = static_cast<T>(1.0 - p.beta1), one_b2 = static_cast<T>(1.0 - p.beta2);
  const T eps = static_cast<T>(p.eps), wd = static_cast<T>(p.weight_decay);
  const T decay = static_cast<T>(c.decay);
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
    if constexpr (kCopies<C>) copy[i] = static_cast<C>(param[i]);
  }
}

}  // namespace

void CpuBackend::sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf,
                          const SgdParams& p) {
  dispatch_floating(param.dtype(), "sgd_step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_copy<T>(p.copy_into, "sgd_step", [&](auto ctag) {
      using C = typename decltype(ctag)::type;
      sgd<T, C>(static_cast<T*>(param.raw_data()), static_cast<const T*>(grad.raw_data()),
                momentum_buf.defined() ? static_cast<T*>(momentum_buf.raw_data()) : nullptr,
                copy_ptr<C>(p.copy_into),
                param.numel(), p);
    });
  });
}

void CpuBackend::adam_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                           const Tensor& v, const AdamParams& p) {
  dispatch_floating(param.dtype(), "adam_step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_copy<T>(p.copy_into, "adam_step", [&](auto ctag) {
      using C = typename decltype(ctag)::type;
      adam<T, C>(static_cast<T*>(param.raw_data()), static_cast<const T*>(grad.raw_data()),
                 static_cast<T*>(m.raw_data()), static_cast<T*>(v.raw_data()),
                 copy_ptr<C>(p.copy_into),
                 param.numel(), p);
    });
  });
}

// The CPU runs a kernel when it is called, so the count and the learning rate are read here,
// on the host: no synchronization to wait for. t is counted in float32 as PyTorch keeps it,
// exact up to 2^24 steps, where it equals the host path's int64 count.
void CpuBackend::adam_advance_step(const Tensor& step, const Tensor& lr, const Tensor& consts,
                                   const AdamParams& p) {
  float* t = step.data<float>();
  *t += 1.0f;
  const AdamStepConsts c = adam_step_consts(*lr.data<double>(), static_cast<double>(*t), p);
  double* out = consts.data<double>();
  out[0] = c.step_size;
  out[1] = c.inv_bc2_sqrt;
  out[2] = c.decay;
}

}  // namespace tandem::cpu
