// Batch normalization over [N, C, H*W] (H*W = 1 for [N, C] inputs), per channel, with own
// kernels that follow kernels/cpu/batchnorm.cpp formula for formula: statistics in double,
// a two-pass variance (mean first, then the squared deviations: no E[x^2] - E[x]^2
// cancellation), the biased variance for normalizing, the unbiased one for running_var.
//
// Training and backward run one block per channel; each block reduces its channel in a fixed
// order (deterministic, no atomics) and then writes the channel's outputs, so one launch does
// the whole op. A channel's data is read two or three times, mostly from L2.
#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tandem {

namespace gpu {
namespace {

constexpr int kChannelThreads = 512;

struct BnGeom {
  int64_t n, c, hw;
};

BnGeom bn_geom(const Tensor& x) {
  const int64_t n = x.size(0), c = x.size(1);
  return {n, c, n * c == 0 ? 0 : x.numel() / (n * c)};
}

template <typename T>
__global__ void bn_train_kernel(const T* x, const T* gamma, const T* beta, T* running_mean,
                                T* running_var, double momentum, double eps, T* y, T* save_mean,
                                T* save_invstd, BnGeom g) {
  const int64_t c = blockIdx.x;
  const double m = static_cast<double>(g.n * g.hw);
  double s = 0;
  for_channel(g.n, g.c, g.hw, c, [&](int64_t off) { s += x[off]; });
  const double mean = block_reduce(s, SumOp{}, 0.0) / m;
  double ss = 0;
  for_channel(g.n, g.c, g.hw, c, [&](int64_t off) {
    const double d = static_cast<double>(x[off]) - mean;
    ss += d * d;
  });
  ss = block_reduce(ss, SumOp{}, 0.0);
  const double var = ss / m;
  const double invstd = 1.0 / sqrt(var + eps);
  const T mu = static_cast<T>(mean);
  const T scale = static_cast<T>(invstd * static_cast<double>(gamma[c]));
  const T shift = beta[c];
  for_channel(g.n, g.c, g.hw, c, [&](int64_t off) { y[off] = (x[off] - mu) * scale + shift; });
  if (threadIdx.x == 0) {
    save_mean[c] = static_cast<T>(mean);
    save_invstd[c] = static_cast<T>(invstd);
    const double unbiased = m > 1 ? ss / (m - 1) : var;
    running_mean[c] = static_cast<T>((1 - momentum) * running_mean[c] + momentum * mean);
    running_var[c] = static_cast<T>((1 - momentum) * running_var[c] + momentum * unbiased);
  }
}

// y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta, elementwise.
template <typename T>
__global__ void bn_eval_kernel(const T* x, const T* gamma, const T* beta, const T* running_mean,
                               const T* running_var, double eps, T* y, int64_t total, BnGeom g) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t c = (i / g.hw) % g.c;
    const double invstd = 1.0 / sqrt(static_cast<double>(running_var[c]) + eps);
    const T scale = static_cast<T>(invstd * static_cast<double>(gamma[c]));
    y[i] = (x[i] - running_mean[c]) * scale + beta[c];
  }
}

// With xhat = (x - mean) * invstd and M values per channel:
//   dbeta = sum(dy), dgamma = sum(dy * xhat),
//   dx = gamma * invstd / M * (M * dy - dbeta - xhat * dgamma) = a * dy + b * (x - mean) + d.
template <typename T>
__global__ void bn_backward_kernel(const T* dy, const T* x, const T* gamma, const T* save_mean,
                                   const T* save_invstd, T* dx, T* dgamma, T* dbeta, BnGeom g) {
  const int64_t c = blockIdx.x;
  const double m = static_cast<double>(g.n * g.hw);
  const double mean = save_mean[c], invstd = save_invstd[c];
  double sdy = 0, sdyx = 0;
  for_channel(g.n, g.c, g.hw, c, [&](int64_t off) {
    sdy += dy[off];
    sdyx += static_cast<double>(dy[off]) * (static_cast<double>(x[off]) - mean);
  });
  sdy = block_reduce(sdy, SumOp{}, 0.0);
  sdyx = block_reduce(sdyx, SumOp{}, 0.0);
  const double dg = sdyx * invstd;
  if (threadIdx.x == 0) {
    dbeta[c] = static_cast<T>(sdy);
    dgamma[c] = static_cast<T>(dg);
  }
  if (m == 0) return;
  const double k = static_cast<double>(gamma[c]) * invstd / m;
  const T a = static_cast<T>(k * m);
  const T b = static_cast<T>(-k * dg * invstd);
  const T d = static_cast<T>(-k * sdy);
  const T mu = static_cast<T>(mean);
  for_channel(g.n, g.c, g.hw, c, [&](int64_t off) { dx[off] = a * dy[off] + b * (x[off] - mu) + d; });
}

}  // namespace
}  // namespace gpu

void CudaBackend::batch_norm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                           const Tensor& running_mean, const Tensor& running_var,
                                           double momentum, double eps, const Tensor& y,
                                           const Tensor& save_mean, const Tensor& save_invstd) {
  const gpu::BnGeom g = gpu::bn_geom(x);
  if (g.c == 0) return;
  DeviceGuard guard(x.device());
  dispatch_floating(x.dtype(), "batch_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::bn_train_kernel<T><<<static_cast<unsigned>(g.c), gpu::kChannelThreads, 0,
                              current_cuda_stream(x.device())>>>(
        gpu::cptr<T>(x), gpu::cptr<T>(gamma), gpu::cptr<T>(beta), gpu::ptr<T>(running_mean),
        gpu::ptr<T>(running_var), momentum, eps, gpu::ptr<T>(y), gpu::ptr<T>(save_mean),
        gpu::ptr<T>(save_invstd), g);
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::batch_norm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                          const Tensor& running_mean, const Tensor& running_var,
                                          double eps, const Tensor& y) {
  const gpu::BnGeom g = gpu::bn_geom(x);
  const int64_t total = x.numel();
  if (total == 0) return;
  DeviceGuard guard(x.device());
  dispatch_floating(x.dtype(), "batch_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::bn_eval_kernel<T><<<gpu::grid_for(total), gpu::kBlock, 0, current_cuda_stream(x.device())>>>(
        gpu::cptr<T>(x), gpu::cptr<T>(gamma), gpu::cptr<T>(beta), gpu::cptr<T>(running_mean),
        gpu::cptr<T>(running_var), eps, gpu::ptr<T>(y), total, g);
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                      const Tensor& save_mean, const Tensor& save_invstd,
                                      const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta) {
  const gpu::BnGeom g = gpu::bn_geom(x);
  if (g.c == 0) return;
  DeviceGuard guard(x.device());
  dispatch_floating(x.dtype(), "batch_norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::bn_backward_kernel<T><<<static_cast<unsigned>(g.c), gpu::kChannelThreads, 0,
                                 current_cuda_stream(x.device())>>>(
        gpu::cptr<T>(dy), gpu::cptr<T>(x), gpu::cptr<T>(gamma), gpu::cptr<T>(save_mean),
        gpu::cptr<T>(save_invstd), gpu::ptr<T>(dx), gpu::ptr<T>(dgamma), gpu::ptr<T>(dbeta), g);
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace tandem
