// 2-D max and average pooling: cuDNN for the forward pass of both modes and the backward of
// average pooling; an own kernel for the backward of max pooling.
//
// Descriptors are built once per configuration and kept in a thread_local map, like the
// convolution plans (Note [conv plans] in conv.cu). Average pooling is
// CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING (divide by the whole window, as Pool2dParams
// says); max pooling propagates NaN, as the CPU backend does.
//
// Note [max pool backward]: the contract routes each dy to the *first* maximum of its window
// (row-major; a NaN is the maximum; padding never wins). cuDNN documents no tie rule, and ties
// are common in practice (max pooling after a ReLU sees windows of zeros), so the backward is
// our own gather kernel: one thread per input element visits the few windows that contain it,
// finds each window's first maximum exactly as the CPU does, and sums the dy of the windows
// it wins, in the CPU's order. No atomics: deterministic and bit-compatible with the CPU.
#include <map>
#include <memory>

#include "core/device.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cudnn_util.h"
#include "kernels/cuda/handles.h"

namespace tandem {

namespace gpu {
namespace {

struct PoolPlan {
  TensorDesc x, y;  // x [N, C, H, W], y [N, C, P, Q]
  PoolDesc pool;
};

const PoolPlan& get_pool_plan(PoolMode mode, const Shape& xs, const Shape& ys,
                              const Pool2dParams& p, DType dtype) {
  using Key = std::array<int64_t, 14>;
  thread_local std::map<Key, std::unique_ptr<PoolPlan>> plans;
  const Key key{static_cast<int64_t>(mode), static_cast<int64_t>(dtype), xs[0], xs[1], xs[2],
                xs[3], ys[2], ys[3], p.kernel_h, p.kernel_w, p.stride_h, p.stride_w, p.pad_h,
                p.pad_w};
  auto it = plans.find(key);
  if (it != plans.end()) return *it->second;

  auto plan = std::make_unique<PoolPlan>();
  const cudnnDataType_t dt = cudnn_dtype(dtype);
  set_tensor4d(plan->x, dt, xs);
  set_tensor4d(plan->y, dt, ys);
  TANDEM_CUDNN_CHECK(cudnnSetPooling2dDescriptor(
      plan->pool.d,
      mode == PoolMode::Max ? CUDNN_POOLING_MAX : CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING,
      CUDNN_PROPAGATE_NAN, to_int(p.kernel_h), to_int(p.kernel_w), to_int(p.pad_h),
      to_int(p.pad_w), to_int(p.stride_h), to_int(p.stride_w)));
  int n = 0, c = 0, oh = 0, ow = 0;
  TANDEM_CUDNN_CHECK(cudnnGetPooling2dForwardOutputDim(plan->pool.d, plan->x.d, &n, &c, &oh, &ow));
  TANDEM_CHECK(n == ys[0] && c == ys[1] && oh == ys[2] && ow == ys[3], Shape, "pool2d: x ",
               shape_str(xs), " gives an output [", n, ",", c, ",", oh, ",", ow, "], not ",
               shape_str(ys));
  return *(plans[key] = std::move(plan));
}

struct PoolGeom {
  int64_t h, w, p, q;
  int64_t kh, kw, sh, sw, ph, pw;
};

// Offset within the plane of the first maximum of window (p, q), clipped to the input;
// the same scan as the CPU's argmax_window.
template <typename T>
__device__ int64_t window_argmax(const T* xp, const PoolGeom& g, int64_t p, int64_t q) {
  const int64_t hs = p * g.sh - g.ph, ws = q * g.sw - g.pw;
  const int64_t h0 = hs > 0 ? hs : 0, h1 = hs + g.kh < g.h ? hs + g.kh : g.h;
  const int64_t w0 = ws > 0 ? ws : 0, w1 = ws + g.kw < g.w ? ws + g.kw : g.w;
  int64_t best = h0 * g.w + w0;
  T m = lowest_value<T>();
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t w = w0; w < w1; ++w) {
      const T v = xp[h * g.w + w];
      if (v > m || v != v) {
        m = v;
        best = h * g.w + w;
        if (v != v) return best;
      }
    }
  }
  return best;
}

// dx [planes, H, W] from dy [planes, P, Q]; see Note [max pool backward].
template <typename T>
__global__ void max_pool_backward_kernel(const T* x, const T* dy, T* dx, int64_t total,
                                         PoolGeom g) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t plane = i / (g.h * g.w);
    const int64_t pos = i - plane * g.h * g.w;
    const int64_t h = pos / g.w, w = pos - (pos / g.w) * g.w;
    const T* xp = x + plane * g.h * g.w;
    const T* dyp = dy + plane * g.p * g.q;
    // Windows p with p*sh - ph <= h < p*sh - ph + kh, clipped to [0, P); the same for q.
    const int64_t hp = h + g.ph, wp = w + g.pw;
    const int64_t p0 = hp < g.kh ? 0 : (hp - g.kh) / g.sh + 1;
    const int64_t p1 = hp / g.sh + 1 < g.p ? hp / g.sh + 1 : g.p;
    const int64_t q0 = wp < g.kw ? 0 : (wp - g.kw) / g.sw + 1;
    const int64_t q1 = wp / g.sw + 1 < g.q ? wp / g.sw + 1 : g.q;
    T acc = T(0);
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t q = q0; q < q1; ++q) {
        if (window_argmax(xp, g, p, q) == pos) acc += dyp[p * g.q + q];
      }
    }
    dx[i] = acc;
  }
}

// Note [activation + pooling] (kernels/backend.h), for windows that tile the input (kernel =
// stride, no padding): one thread per output (window), forward and backward, the activation
// recomputed from z. The arithmetic is the CPU's (kernels/cpu/pool.cpp): a window's average
// adds each column's rows first, then the columns, and multiplies by 1 / area; its maximum is
// the first in row-major order, a NaN winning.
struct TileGeom {
  unsigned planes;  // N * C
  unsigned h, w, p, q, kh, kw;
  unsigned channels;  // C: plane % C is the channel of a bias
};

// The activation of z's element `at` of a window of `plane`, with a bias z + bias[c] first
// (Note [conv bias in activation + pooling] in kernels/ops.h; the add in T, the convolution's).
template <typename T, Activation A>
struct WindowActivation {
  const T* z;
  bool biased;
  T b;
  __device__ WindowActivation(const T* z_, const T* bias, unsigned plane, unsigned channels)
      : z(z_), biased(bias != nullptr), b(bias != nullptr ? bias[plane % channels] : T(0)) {}
  __device__ T operator()(unsigned at) const { return activate<T, A>(biased ? z[at] + b : z[at]); }
};

template <typename T, Activation A, PoolMode M>
__global__ void activation_pool_forward_kernel(const T* __restrict__ z, const T* __restrict__ bias,
                                               T* __restrict__ y, TileGeom g) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  // 32-bit indices (the dispatcher keeps z below 2^31 elements): 64-bit division is several
  // times slower, and these kernels are mostly index arithmetic.
  const unsigned total = g.planes * g.p * g.q;
  const T inv_area = T(1) / static_cast<T>(g.kh * g.kw);
  for (unsigned o = blockIdx.x * blockDim.x + threadIdx.x; o < total; o += gridDim.x * blockDim.x) {
    const unsigned qi = o % g.q, rest = o / g.q, pi = rest % g.p, plane = rest / g.p;
    const T* zp = z + (plane * g.h + pi * g.kh) * g.w + qi * g.kw;
    const WindowActivation<T, A> a(zp, bias, plane, g.channels);
    T out;
    if constexpr (M == PoolMode::Avg) {
      T sum = 0;
      for (unsigned s = 0; s < g.kw; ++s) {
        T col = a(s);
        for (unsigned r = 1; r < g.kh; ++r) col += a(r * g.w + s);
        sum = s == 0 ? col : sum + col;
      }
      out = sum * inv_area;
    } else {
      out = -static_cast<T>(INFINITY);
      bool nan = false;
      for (unsigned r = 0; r < g.kh && !nan; ++r) {
        for (unsigned s = 0; s < g.kw && !nan; ++s) {
          const T v = a(r * g.w + s);
          if (v > out || v != v) out = v, nan = v != v;
        }
      }
    }
    y[o] = out;
  }
}

// One thread per window: the window's place is worked out once for its kh * kw elements, its
// dy loaded once and, for max pooling, its first maximum found once (one thread per element
// took twice as long, mostly in the index divisions and the repeated scans). Elements in no
// window (the last rows or columns when a window does not divide the input) get 0.
template <typename T, Activation A, PoolMode M>
__global__ void activation_pool_backward_kernel(const T* __restrict__ dy, const T* __restrict__ z,
                                                const T* __restrict__ bias, T* __restrict__ dz, TileGeom g) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  const unsigned windows = g.planes * g.p * g.q;
  const T inv_area = T(1) / static_cast<T>(g.kh * g.kw);
  for (unsigned o = blockIdx.x * blockDim.x + threadIdx.x; o < windows; o += gridDim.x * blockDim.x) {
    const unsigned qi = o % g.q, rest = o / g.q, pi = rest % g.p, plane = rest / g.p;
    const unsigned base = (plane * g.h + pi * g.kh) * g.w + qi * g.kw;
    const WindowActivation<T, A> a(z, bias, plane, g.channels);
    const T g_out = dy[o];
    unsigned best_r = 0, best_s = 0;
    if constexpr (M == PoolMode::Max) {
      // The window's first maximum (a NaN winning).
      T best = -static_cast<T>(INFINITY);
      bool nan = false;
      for (unsigned r = 0; r < g.kh && !nan; ++r) {
        for (unsigned s = 0; s < g.kw && !nan; ++s) {
          const T v = a(base + r * g.w + s);
          if (v > best || v != v) best = v, best_r = r, best_s = s, nan = v != v;
        }
      }
    }
    for (unsigned r = 0; r < g.kh; ++r) {
      for (unsigned s = 0; s < g.kw; ++s) {
        const unsigned i = base + r * g.w + s;
        T da;
        if constexpr (M == PoolMode::Avg) {
          da = g_out * inv_area;
        } else {
          da = r == best_r && s == best_s ? g_out : T(0);
        }
        dz[i] = activation_grad<T, A>(da, a(i));
      }
    }
  }
  if (g.p * g.kh == g.h && g.q * g.kw == g.w) return;
  const unsigned total = g.planes * g.h * g.w;
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const unsigned wi = i % g.w, hi = (i / g.w) % g.h;
    if (hi >= g.p * g.kh || wi >= g.q * g.kw) dz[i] = T(0);
  }
}

bool tiles_without_padding(const Pool2dParams& p) {
  return p.kernel_h == p.stride_h && p.kernel_w == p.stride_w && p.pad_h == 0 && p.pad_w == 0;
}

TileGeom tile_geom(const Tensor& x, const Pool2dParams& p) {
  const auto u = [](int64_t v) { return static_cast<unsigned>(v); };
  return {u(x.size(0) * x.size(1)), u(x.size(2)), u(x.size(3)), u(x.size(2) / p.kernel_h),
          u(x.size(3) / p.kernel_w), u(p.kernel_h), u(p.kernel_w), u(x.size(1))};
}

// Calls fn(mode as a constant).
template <typename Fn>
void dispatch_pool_mode(PoolMode mode, Fn&& fn) {
  if (mode == PoolMode::Max) return fn(std::integral_constant<PoolMode, PoolMode::Max>{});
  return fn(std::integral_constant<PoolMode, PoolMode::Avg>{});
}

// The launcher of both passes: false, having done nothing, where the fused kernels do not
// apply; otherwise the kernel of the pass, dtype, activation and mode, one thread per window
// (element of y), or per element of dz backward where no window covers any of it. dy is read
// only backward.
template <bool Backward>
bool launch_activation_pool(const char* op, const Tensor& dy, const Tensor& z, const Tensor& bias,
                            Activation act, PoolMode mode, const Pool2dParams& p, const Tensor& out) {
  if (!tiles_without_padding(p) || (z.dtype() != kFloat32 && z.dtype() != kFloat64) ||
      z.numel() >= (int64_t{1} << 31)) {
    return false;
  }
  const int64_t total = Backward ? z.numel() : out.numel();
  if (total == 0) return true;
  DeviceGuard guard(z.device());
  const TileGeom g = tile_geom(z, p);
  const int64_t windows = int64_t{g.planes} * g.p * g.q;
  const unsigned grid = grid_for(windows > 0 ? windows : total);
  dispatch_floating(z.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_activation(act, [&](auto a) {
      dispatch_pool_mode(mode, [&](auto m) {
        constexpr Activation A = decltype(a)::value;
        constexpr PoolMode M = decltype(m)::value;
        cudaStream_t stream = current_cuda_stream(z.device());
        const T* b = bias.defined() ? cptr<T>(bias) : nullptr;
        if constexpr (Backward) {
          launch_after_previous(activation_pool_backward_kernel<T, A, M>, grid, kBlock, stream, cptr<T>(dy),
                                cptr<T>(z), b, ptr<T>(out), g);
        } else {
          launch_after_previous(activation_pool_forward_kernel<T, A, M>, grid, kBlock, stream, cptr<T>(z), b,
                                ptr<T>(out), g);
        }
      });
    });
  });
  return true;
}

}  // namespace
}  // namespace gpu

bool CudaBackend::activation_pool2d_forward(const Tensor& z, const Tensor& bias, Activation act, PoolMode mode,
                                            const Pool2dParams& p, const Tensor& y) {
  return gpu::launch_activation_pool<false>("activation_pool2d", Tensor(), z, bias, act, mode, p, y);
}

bool CudaBackend::activation_pool2d_backward(const Tensor& dy, const Tensor& z, const Tensor& bias, Activation act,
                                             PoolMode mode, const Pool2dParams& p, const Tensor& dz) {
  return gpu::launch_activation_pool<true>("activation_pool2d_backward", dy, z, bias, act, mode, p, dz);
}

void CudaBackend::pool2d_forward(PoolMode mode, const Tensor& x, const Pool2dParams& p,
                                 const Tensor& y) {
  if (y.numel() == 0) return;
  DeviceGuard guard(x.device());
  dispatch_floating(x.dtype(), "pool2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const gpu::PoolPlan& plan = gpu::get_pool_plan(mode, x.shape(), y.shape(), p, x.dtype());
    const T one = 1, zero = 0;
    TANDEM_CUDNN_CHECK(cudnnPoolingForward(gpu::cudnn_handle(x.device()), plan.pool.d, &one,
                                           plan.x.d, x.raw_data(), &zero, plan.y.d, y.raw_data()));
  });
}

void CudaBackend::pool2d_backward(PoolMode mode, const Tensor& x, const Tensor& y, const Tensor& dy,
                                  const Pool2dParams& p, const Tensor& dx) {
  if (dx.numel() == 0) return;
  DeviceGuard guard(dx.device());
  if (dy.numel() == 0) {
    fill(dx, 0.0);
    return;
  }
  dispatch_floating(dx.dtype(), "pool2d_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (mode == PoolMode::Max) {
      const gpu::PoolGeom g{x.size(2), x.size(3), dy.size(2), dy.size(3), p.kernel_h,
                            p.kernel_w,  p.stride_h, p.stride_w, p.pad_h, p.pad_w};
      const int64_t total = dx.numel();
      gpu::max_pool_backward_kernel<T><<<gpu::grid_for(total), gpu::kBlock, 0,
                                         current_cuda_stream(dx.device())>>>(
          gpu::cptr<T>(x), gpu::cptr<T>(dy), gpu::ptr<T>(dx), total, g);
      TANDEM_CUDA_CHECK_LAUNCH();
      return;
    }
    const gpu::PoolPlan& plan = gpu::get_pool_plan(mode, x.shape(), dy.shape(), p, x.dtype());
    const T one = 1, zero = 0;
    // Average pooling reads neither x nor y; cuDNN still wants valid pointers for them.
    const void* yp = y.defined() ? y.raw_data() : dy.raw_data();
    TANDEM_CUDNN_CHECK(cudnnPoolingBackward(gpu::cudnn_handle(dx.device()), plan.pool.d, &one,
                                            plan.y.d, yp, plan.y.d, dy.raw_data(), plan.x.d,
                                            x.raw_data(), &zero, plan.x.d, dx.raw_data()));
  });
}

}  // namespace tandem
