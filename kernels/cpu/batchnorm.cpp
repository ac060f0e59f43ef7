// Batch normalization over [N, C, H*W] (H*W = 1 for [N, C] inputs), per channel.
// Statistics are accumulated in float64 and the variance is two-pass (mean first), which
// avoids the cancellation of E[x^2] - E[x]^2 on inputs with a large mean.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"

namespace tandem::cpu {

namespace {

struct BnGeom {
  int64_t n, c, hw;
  int64_t count() const { return n * hw; }
};

BnGeom geom(const Tensor& x) {
  const int64_t n = x.size(0), c = x.size(1);
  return {n, c, n * c == 0 ? 0 : x.numel() / (n * c)};
}

// Calls fn(ptr, len) for each contiguous block of channel c: one block of H*W per image.
template <typename T, typename Fn>
inline void for_channel(const BnGeom& g, const T* base, int64_t c, Fn fn) {
  for (int64_t i = 0; i < g.n; ++i) fn(base + (i * g.c + c) * g.hw, g.hw);
}

template <typename T>
const T* cptr(const Tensor& t) {
  return static_cast<const T*>(t.raw_data());
}
template <typename T>
T* mptr(const Tensor& t) {
  return static_cast<T*>(t.raw_data());
}

// y = (x - mean) * invstd * gamma + beta on channel c; with relu, then max(y, 0) as the ReLU
// op computes it (Note [batch norm + ReLU] in kernels/backend.h).
template <typename T>
void normalize_channel(const BnGeom& g, const T* x, T* y, int64_t c, double mean, double invstd,
                       double gamma, double beta, bool relu) {
  const T mu = static_cast<T>(mean);
  const T scale = static_cast<T>(invstd * gamma);
  const T shift = static_cast<T>(beta);
  for (int64_t i = 0; i < g.n; ++i) {
    const int64_t off = (i * g.c + c) * g.hw;
    for (int64_t j = 0; j < g.hw; ++j) {
      const T v = (x[off + j] - mu) * scale + shift;
      y[off + j] = relu ? (v > T(0) ? v : T(0)) : v;
    }
  }
}

template <typename T>
void bn_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& rmean,
              const Tensor& rvar, double momentum, double eps, const Tensor& y,
              const Tensor& save_mean, const Tensor& save_invstd, bool relu) {
  const BnGeom g = geom(x);
  const T* px = cptr<T>(x);
  const double m = static_cast<double>(g.count());
  for (int64_t c = 0; c < g.c; ++c) {
    double s = 0;
    for_channel(g, px, c, [&](const T* p, int64_t len) {
      for (int64_t j = 0; j < len; ++j) s += p[j];
    });
    const double mean = s / m;
    double ss = 0;
    for_channel(g, px, c, [&](const T* p, int64_t len) {
      for (int64_t j = 0; j < len; ++j) {
        const double d = static_cast<double>(p[j]) - mean;
        ss += d * d;
      }
    });
    const double var = ss / m;
    const double invstd = 1.0 / std::sqrt(var + eps);
    normalize_channel(g, px, mptr<T>(y), c, mean, invstd, cptr<T>(gamma)[c], cptr<T>(beta)[c], relu);
    mptr<T>(save_mean)[c] = static_cast<T>(mean);
    mptr<T>(save_invstd)[c] = static_cast<T>(invstd);
    T& rm = mptr<T>(rmean)[c];
    T& rv = mptr<T>(rvar)[c];
    const double unbiased = m > 1 ? ss / (m - 1) : var;
    rm = static_cast<T>((1 - momentum) * rm + momentum * mean);
    rv = static_cast<T>((1 - momentum) * rv + momentum * unbiased);
  }
}

template <typename T>
void bn_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& rmean,
             const Tensor& rvar, double eps, const Tensor& y, bool relu) {
  const BnGeom g = geom(x);
  for (int64_t c = 0; c < g.c; ++c) {
    const double invstd = 1.0 / std::sqrt(static_cast<double>(cptr<T>(rvar)[c]) + eps);
    normalize_channel(g, cptr<T>(x), mptr<T>(y), c, cptr<T>(rmean)[c], invstd, cptr<T>(gamma)[c],
                      cptr<T>(beta)[c], relu);
  }
}

// With xhat = (x - mean) * invstd and M values per channel:
//   dbeta = sum(dy), dgamma = sum(dy * xhat),
//   dx = gamma * invstd / M * (M * dy - dbeta - xhat * dgamma).
// dy is already masked by the ReLU when there is one (CpuBackend::batch_norm_backward).
template <typename T>
void bn_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                 const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma,
                 const Tensor& dbeta) {
  const BnGeom g = geom(x);
  const T* px = cptr<T>(x);
  const T* pdy = cptr<T>(dy);
  T* pdx = mptr<T>(dx);
  const double m = static_cast<double>(g.count());
  for (int64_t c = 0; c < g.c; ++c) {
    const double mean = cptr<T>(save_mean)[c], invstd = cptr<T>(save_invstd)[c];
    double sdy = 0, sdyx = 0;
    for (int64_t i = 0; i < g.n; ++i) {
      const int64_t off = (i * g.c + c) * g.hw;
      for (int64_t j = 0; j < g.hw; ++j) {
        sdy += pdy[off + j];
        sdyx += static_cast<double>(pdy[off + j]) * (static_cast<double>(px[off + j]) - mean);
      }
    }
    const double dg = sdyx * invstd;
    mptr<T>(dbeta)[c] = static_cast<T>(sdy);
    mptr<T>(dgamma)[c] = static_cast<T>(dg);
    if (m == 0) continue;
    // dx = a * dy + b * (x - mean) + d: the same formula with the per-channel constants
    // hoisted out of the inner loop.
    const double k = cptr<T>(gamma)[c] * invstd / m;
    const T a = static_cast<T>(k * m);
    const T b = static_cast<T>(-k * dg * invstd);
    const T d = static_cast<T>(-k * sdy);
    const T mu = static_cast<T>(mean);
    for (int64_t i = 0; i < g.n; ++i) {
      const int64_t off = (i * g.c + c) * g.hw;
      for (int64_t j = 0; j < g.hw; ++j) {
        pdx[off + j] = a * pdy[off + j] + b * (px[off + j] - mu) + d;
      }
    }
  }
}

// z + bias[c] in z's dtype, each sum rounded once: the input of a batch norm that takes a
// conv's bias, as the CUDA convolution's bias add computes it (Note [conv bias in batch norm]
// in kernels/cuda/batchnorm.cuh). The CPU, the reference, writes it out and runs the plain
// kernels on it.
Tensor add_conv_bias(const Tensor& z, const Tensor& bias) {
  const BnGeom g = geom(z);
  Tensor x(z.shape(), z.dtype(), z.device());
  dispatch_floating_bf16(z.dtype(), "batch_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* pz = cptr<T>(z);
    T* px = mptr<T>(x);
    for (int64_t i = 0; i < g.n; ++i) {
      for (int64_t c = 0; c < g.c; ++c) {
        const int64_t off = (i * g.c + c) * g.hw;
        const T b = cptr<T>(bias)[c];
        for (int64_t j = 0; j < g.hw; ++j) px[off + j] = pz[off + j] + b;
      }
    }
  });
  return x;
}

}  // namespace

void CpuBackend::batch_norm_forward_train(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                                          const Tensor& beta, const Tensor& running_mean,
                                          const Tensor& running_var, double momentum, double eps,
                                          const Tensor& y, const Tensor& save_mean,
                                          const Tensor& save_invstd, bool relu, const Tensor& residual,
                                          const Tensor& num_batches_tracked) {
  if (num_batches_tracked.defined()) {
    batch_norm_forward_train(x, bias, gamma, beta, running_mean, running_var, momentum, eps, y, save_mean,
                             save_invstd, relu, residual, Tensor());
    mptr<int64_t>(num_batches_tracked)[0] += 1;
    return;
  }
  if (residual.defined()) {  // the reference composes the two ops: relu(y + residual) in place
    batch_norm_forward_train(x, bias, gamma, beta, running_mean, running_var, momentum, eps, y, save_mean,
                             save_invstd, false, Tensor(), Tensor());
    binary(BinaryOp::AddRelu, y, residual, y);
    return;
  }
  if (bias.defined()) {
    batch_norm_forward_train(add_conv_bias(x, bias), Tensor(), gamma, beta, running_mean, running_var,
                             momentum, eps, y, save_mean, save_invstd, relu, Tensor(), Tensor());
    return;
  }
  if (x.dtype() == kBFloat16) {  // Note [bfloat16 on the CPU] in conv.cpp; the rest is float32
    // relu before the rounding: it commutes with it (monotonic, and 0 is exact).
    Tensor yf(y.shape(), kFloat32, y.device());
    batch_norm_forward_train(x.to(kFloat32), Tensor(), gamma, beta, running_mean, running_var, momentum,
                             eps, yf, save_mean, save_invstd, relu, Tensor(), Tensor());
    y.copy_(yf);
    return;
  }
  dispatch_floating(x.dtype(), "batch_norm", [&](auto tag) {
    bn_train<typename decltype(tag)::type>(x, gamma, beta, running_mean, running_var, momentum, eps,
                                           y, save_mean, save_invstd, relu);
  });
}

void CpuBackend::batch_norm_forward_eval(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                                         const Tensor& beta, const Tensor& running_mean,
                                         const Tensor& running_var, double eps, const Tensor& y,
                                         bool relu) {
  if (bias.defined()) {
    batch_norm_forward_eval(add_conv_bias(x, bias), Tensor(), gamma, beta, running_mean, running_var, eps, y,
                            relu);
    return;
  }
  if (x.dtype() == kBFloat16) {
    Tensor yf(y.shape(), kFloat32, y.device());
    batch_norm_forward_eval(x.to(kFloat32), Tensor(), gamma, beta, running_mean, running_var, eps, yf, relu);
    y.copy_(yf);
    return;
  }
  dispatch_floating(x.dtype(), "batch_norm", [&](auto tag) {
    bn_eval<typename decltype(tag)::type>(x, gamma, beta, running_mean, running_var, eps, y, relu);
  });
}

void CpuBackend::batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& bias,
                                     const Tensor& gamma, const Tensor& save_mean,
                                     const Tensor& save_invstd, const Tensor& relu_out,
                                     const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                                     const Tensor& dbias, const Tensor& masked_dy, const Tensor& dy_part) {
  if (dy_part.defined()) {  // the engine's add, in a pass of its own (Note [gradient parts])
    Tensor sum(dy.shape(), dy.dtype(), dy.device());
    binary(BinaryOp::Add, dy, dy_part, sum);
    batch_norm_backward(sum, x, bias, gamma, save_mean, save_invstd, relu_out, dx, dgamma, dbeta, dbias, masked_dy,
                        Tensor());
    return;
  }
  if (bias.defined() || dbias.defined()) {
    // The input written out again, and the bias gradient with the convolution's own routine.
    batch_norm_backward(dy, bias.defined() ? add_conv_bias(x, bias) : x, Tensor(), gamma, save_mean,
                        save_invstd, relu_out, dx, dgamma, dbeta, Tensor(), masked_dy, Tensor());
    if (dbias.defined()) {  // float32 for a bfloat16 x: the sums rounded to bfloat16, then stored
      const Tensor db = dbias.dtype() == dx.dtype() ? dbias : Tensor(dbias.shape(), dx.dtype(), dx.device());
      conv2d_backward_bias(dx, db);
      if (!db.same(dbias)) dbias.copy_(db);
    }
    return;
  }
  if (relu_out.defined()) {
    // The ReLU's backward first, exactly as the ReluBackward op computes it; the CPU is the
    // reference, so it may take the extra pass that the CUDA kernels fuse away.
    const Tensor masked = masked_dy.defined() ? masked_dy : Tensor(dy.shape(), dy.dtype(), dy.device());
    binary(BinaryOp::ReluBackward, dy, relu_out, masked);
    batch_norm_backward(masked, x, Tensor(), gamma, save_mean, save_invstd, Tensor(), dx, dgamma, dbeta,
                        Tensor(), Tensor(), Tensor());
    return;
  }
  if (x.dtype() == kBFloat16) {
    Tensor dxf(dx.shape(), kFloat32, dx.device());
    batch_norm_backward(dy.to(kFloat32), x.to(kFloat32), Tensor(), gamma, save_mean, save_invstd, Tensor(),
                        dxf, dgamma, dbeta, Tensor(), Tensor(), Tensor());
    dx.copy_(dxf);
    return;
  }
  dispatch_floating(x.dtype(), "batch_norm_backward", [&](auto tag) {
    bn_backward<typename decltype(tag)::type>(dy, x, gamma, save_mean, save_invstd, dx, dgamma,
                                              dbeta);
  });
}

}  // namespace tandem::cpu
