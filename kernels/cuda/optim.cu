// Fused optimizer updates: one pass over each parameter tensor, following torch.optim.SGD and
// torch.optim.Adam/AdamW (single-tensor, non-amsgrad) step by step, with the same constants
// and the same operation order as kernels/cpu/optim.cpp. The scalar constants (bias
// corrections, 1 - beta, ...) are computed once on the host in double and passed in the
// element type -- except in a capturable step (Note [capturable optimizer steps] in
// nn/optim/optimizer.h), where the learning rate and Adam's step-dependent constants are
// doubles in device memory that every thread reads and casts, as the host would have. With
// copy_into (SgdParams, AdamParams) each new value is also stored cast to the copy's type C, by
// the conversion the copy kernel uses (CastFn's static_cast in elementwise.cu), so the copy is
// a cast's bits (Note [the weight copy written by the update] in nn/optim/optimizer.h).
#include <cmath>

#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/optim_copy.h"

namespace tandem {

namespace gpu {
namespace {

using kernels::copy_ptr;
using kernels::dispatch_copy;
using kernels::kCopies;
using kernels::NoCopy;

template <typename T>
struct SgdConsts {
  T lr, wd, mom, damp;  // damp = 1 - dampening
  bool use_wd, use_momentum, first_step, nesterov;
};

// d = g + wd * p; with momentum, buf = d on the first step, else
// buf = momentum * buf + (1 - dampening) * d, and d = nesterov ? d + momentum * buf : buf;
// finally p -= lr * d. lr_mem (capturable): the learning rate in memory instead of k.lr.
// copy (C not NoCopy): copy[i] = the new p, cast.
template <typename T, typename C>
__global__ void sgd_kernel(T* param, const T* grad, T* buf, C* copy, int64_t n, SgdConsts<T> k,
                           const double* lr_mem) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  if (lr_mem != nullptr) k.lr = static_cast<T>(*lr_mem);  // round to nearest, as on the host
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    T d = k.use_wd ? grad[i] + k.wd * param[i] : grad[i];
    if (k.use_momentum) {
      const T b = k.first_step ? d : k.mom * buf[i] + k.damp * d;
      buf[i] = b;
      d = k.nesterov ? d + k.mom * b : b;
    }
    param[i] -= k.lr * d;
    if constexpr (kCopies<C>) copy[i] = static_cast<C>(param[i]);
  }
}

template <typename T>
struct AdamConsts {
  T step_size, inv_bc2_sqrt, b1, b2, one_b1, one_b2, eps, wd, decay;
  bool use_wd, decoupled;
};

// g += wd * p (Adam) or p *= 1 - lr * wd (AdamW); m = b1 m + (1 - b1) g;
// v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
// consts (capturable): {step_size, inv_bc2_sqrt, decay} in memory, as adam_advance_kernel
// wrote them. copy (C not NoCopy): copy[i] = the new p, cast.
template <typename T, typename C>
__global__ void adam_kernel(T* param, const T* grad, T* m, T* v, C* copy, int64_t n,
                            AdamConsts<T> k, const double* consts) {
  if (consts != nullptr) {
    k.step_size = static_cast<T>(consts[0]);
    k.inv_bc2_sqrt = static_cast<T>(consts[1]);
    k.decay = static_cast<T>(consts[2]);
  }
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
    const T updated = p - k.step_size * mi / denom;
    param[i] = updated;
    if constexpr (kCopies<C>) copy[i] = static_cast<C>(updated);
  }
}

// Note [device Adam constants]: the twin of adam_step_consts in kernels/cpu/optim.cpp, one
// thread. Division, square root and the 1 - lr * wd are IEEE operations rounded to nearest on
// both sides; the explicit _rn intrinsics keep nvcc from contracting lr * wd into an FMA, which
// the host (x86-64 without FMA) does not do, so decay is the host's bits. pow is not: CUDA's
// double pow is within 2 ulp (CUDA Math API), glibc's within 1, so beta^t may differ by a few
// ulp of a number below 1, i.e. by at most 3 * 2^-53 absolute; 1 - beta^t then differs
// relatively by that over 1 - beta^t. Cast to float32 the constants are almost always the
// host's bits, but that is not a guarantee (tests/nn/test_optim_capturable.cpp checks the bound).
__global__ void adam_advance_kernel(float* step, const double* lr, double* consts, double beta1,
                                    double beta2, double weight_decay) {
  const float t = *step + 1.0f;
  *step = t;
  const double bc1 = __dsub_rn(1.0, pow(beta1, static_cast<double>(t)));
  const double bc2 = __dsub_rn(1.0, pow(beta2, static_cast<double>(t)));
  const double lr_v = *lr;
  consts[0] = __ddiv_rn(lr_v, bc1);
  consts[1] = __ddiv_rn(1.0, __dsqrt_rn(bc2));
  consts[2] = __dsub_rn(1.0, __dmul_rn(lr_v, weight_decay));
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
    gpu::dispatch_copy<T>(p.copy_into, "sgd_step", [&](auto ctag) {
      using C = typename decltype(ctag)::type;
      gpu::launch_after_previous(gpu::sgd_kernel<T, C>, gpu::grid_for(n), gpu::kBlock,
                                 current_cuda_stream(param.device()), gpu::ptr<T>(param),
                                 gpu::cptr<T>(grad),
                                 use_momentum ? gpu::ptr<T>(momentum_buf) : nullptr,
                                 gpu::copy_ptr<C>(p.copy_into), n, k,
                                 p.lr_tensor.defined() ? gpu::cptr<double>(p.lr_tensor) : nullptr);
    });
  });
}

void CudaBackend::adam_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                            const Tensor& v, const AdamParams& p) {
  const int64_t n = param.numel();
  if (n == 0) return;
  DeviceGuard guard(param.device());
  dispatch_floating(param.dtype(), "adam_step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // Capturable: the kernel reads these three from p.consts; p.step and p.lr are unused.
    const bool in_memory = p.consts.defined();
    const double bc1 = in_memory ? 1.0 : 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
    const double bc2 = in_memory ? 1.0 : 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
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
    gpu::dispatch_copy<T>(p.copy_into, "adam_step", [&](auto ctag) {
      using C = typename decltype(ctag)::type;
      gpu::adam_kernel<T, C><<<gpu::grid_for(n), gpu::kBlock, 0, current_cuda_stream(param.device())>>>(
          gpu::ptr<T>(param), gpu::cptr<T>(grad), gpu::ptr<T>(m), gpu::ptr<T>(v),
          gpu::copy_ptr<C>(p.copy_into), n, k, in_memory ? gpu::cptr<double>(p.consts) : nullptr);
      TANDEM_CUDA_CHECK_LAUNCH();
    });
  });
}

void CudaBackend::adam_advance_step(const Tensor& step, const Tensor& lr, const Tensor& consts,
                                    const AdamParams& p) {
  DeviceGuard guard(step.device());
  gpu::adam_advance_kernel<<<1, 1, 0, current_cuda_stream(step.device())>>>(
      gpu::ptr<float>(step), gpu::cptr<double>(lr), gpu::ptr<double>(consts), p.beta1, p.beta2,
      p.weight_decay);
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem
