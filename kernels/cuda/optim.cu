// Fused optimizer updates: one pass over each parameter tensor, following torch.optim.SGD and
// torch.optim.Adam/AdamW (single-tensor, non-amsgrad) step by step, with the same constants
// and the same operation order as kernels/cpu/optim.cpp. The scalar constants (bias
// corrections, 1 - beta, ...) are computed once on the host in double and passed in the
// element type.
#include <cmath>

#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tandem {

namespace gpu {
namespace {

template <typename T>
struct SgdConsts {
  T lr, wd, mom, damp;  // damp = 1 - dampening
  bool use_wd, use_momentum, first_step, nesterov;
};

// d = g + wd * p; with momentum, buf = d on the first step, else
// buf = momentum * buf + (1 - dampening) * d, and d = nesterov ? d + momentum * buf : buf;
// finally p -= lr * d.
template <typename T>
__global__ void sgd_kernel(T* param, const T* grad, T* buf, int64_t n, SgdConsts<T> k) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    T d = k.use_wd ? grad[i] + k.wd * param[i] : grad[i];
    if (k.use_momentum) {
      const T b = k.first_step ? d : k.mom * buf[i] + k.damp * d;
      buf[i] = b;
      d = k.nesterov ? d + k.mom * b : b;
    }
    param[i] -= k.lr * d;
  }
}

template <typename T>
struct AdamConsts {
  T step_size, inv_bc2_sqrt, b1, b2, one_b1, one_b2, eps, wd, decay;
  bool use_wd, decoupled;
};

// g += wd * p (Adam) or p *= 1 - lr * wd (AdamW); m = b1 m + (1 - b1) g;
// v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
template <typename T>
__global__ void adam_kernel(T* param, const T* grad, T* m, T* v, int64_t n, AdamConsts<T> k) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    T g = grad[i];
    T p = param[i];
    if (k.use_wd) {
      if (k.decoupled) {
        p *= k.decay;
      } else {
        g += k.wd * p;
      }
    }
    const T mi = k.b1 * m[i] + k.one_b1 * g;
    const T vi = k.b2 * v[i] + k.one_b2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const T denom = d_sqrt(vi) * k.inv_bc2_sqrt + k.eps;
    param[i] = p - k.step_size * mi / denom;
  }
}

}  // namespace
}  // namespace gpu

void CudaBackend::sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf,
                           const SgdParams& p) {
  const int64_t n = param.numel();
  if (n == 0) return;
  const bool use_momentum = p.momentum != 0.0;
  TANDEM_CHECK(!use_momentum || momentum_buf.defined(), Value,
               "sgd_step: momentum ", p.momentum, " needs a momentum buffer");
  DeviceGuard guard(param.device());
  dispatch_floating(param.dtype(), "sgd_step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const gpu::SgdConsts<T> k{static_cast<T>(p.lr),       static_cast<T>(p.weight_decay),
                              static_cast<T>(p.momentum), static_cast<T>(1.0 - p.dampening),
                              p.weight_decay != 0.0,      use_momentum,
                              p.first_step,               p.nesterov};
    gpu::sgd_kernel<T><<<gpu::grid_for(n), gpu::kBlock, 0, current_cuda_stream(param.device())>>>(
        gpu::ptr<T>(param), gpu::cptr<T>(grad), use_momentum ? gpu::ptr<T>(momentum_buf) : nullptr,
        n, k);
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::adam_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                            const Tensor& v, const AdamParams& p) {
  const int64_t n = param.numel();
  if (n == 0) return;
  DeviceGuard guard(param.device());
  dispatch_floating(param.dtype(), "adam_step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
    const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
    const gpu::AdamConsts<T> k{static_cast<T>(p.lr / bc1),
                               static_cast<T>(1.0 / std::sqrt(bc2)),
                               static_cast<T>(p.beta1),
                               static_cast<T>(p.beta2),
                               static_cast<T>(1.0 - p.beta1),
                               static_cast<T>(1.0 - p.beta2),
                               static_cast<T>(p.eps),
                               static_cast<T>(p.weight_decay),
                               static_cast<T>(1.0 - p.lr * p.weight_decay),
                               p.weight_decay != 0.0,
                               p.decoupled_weight_decay};
    gpu::adam_kernel<T><<<gpu::grid_for(n), gpu::kBlock, 0, current_cuda_stream(param.device())>>>(
        gpu::ptr<T>(param), gpu::cptr<T>(grad), gpu::ptr<T>(m), gpu::ptr<T>(v), n, k);
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace tandem
