// 2-D max and average pooling over [N, C, H, W], one (n, c) plane at a time.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")  // Note [no-trapping-math] in elementwise.cpp
#endif
#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace tandem::cpu {

namespace {

struct PoolGeom {
  int64_t planes, h, w, p, q;
  int64_t kh, kw, sh, sw, ph, pw;
};

PoolGeom geom(const Tensor& x, const Tensor& y, const Pool2dParams& prm) {
  return {x.size(0) * x.size(1), x.size(2),    x.size(3),    y.size(2), y.size(3), prm.kernel_h,
          prm.kernel_w,          prm.stride_h, prm.stride_w, prm.pad_h, prm.pad_w};
}

// The part of output (p, q)'s window that lies inside the input: rows [h0, h1), cols [w0, w1).
struct Window {
  int64_t h0, h1, w0, w1;
};
inline Window window(const PoolGeom& g, int64_t p, int64_t q) {
  const int64_t hs = p * g.sh - g.ph, ws = q * g.sw - g.pw;
  return {std::max<int64_t>(hs, 0), std::min(hs + g.kh, g.h), std::max<int64_t>(ws, 0),
          std::min(ws + g.kw, g.w)};
}

// Offset (within the plane) of the first maximum of a window, scanning row-major. A NaN is
// the maximum, so it propagates as in PyTorch. Padding never wins: it is not scanned.
template <typename T>
int64_t argmax_window(const T* xp, const PoolGeom& g, const Window& win) {
  int64_t best = win.h0 * g.w + win.w0;
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t h = win.h0; h < win.h1; ++h) {
    for (int64_t w = win.w0; w < win.w1; ++w) {
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

// Note [tiling pools]: the usual CNN pool (2x2, stride 2, no padding) tiles the input: every
// input element is in at most one window. Then a window sum is "add kh rows, then add kw
// neighbours", and the first loop runs over whole contiguous rows, which vectorizes. The
// general path below handles overlap and padding one window at a time.
inline bool tiles(const PoolGeom& g) {
  return g.sh == g.kh && g.sw == g.kw && g.ph == 0 && g.pw == 0;
}

template <typename T>
inline T max_nan(T a, T b) {
  return (a > b || a != a) ? a : b;
}

template <typename T>
void pool_forward_tiled(PoolMode mode, const PoolGeom& g, const T* x, T* y) {
  const int64_t span = g.q * g.kw;  // input columns covered by windows
  std::vector<T> rows(static_cast<size_t>(span));
  const T inv_area = T(1) / static_cast<T>(g.kh * g.kw);
  for (int64_t pl = 0; pl < g.planes; ++pl) {
    for (int64_t p = 0; p < g.p; ++p) {
      const T* x0 = x + (pl * g.h + p * g.kh) * g.w;
      T* acc = rows.data();
      for (int64_t j = 0; j < span; ++j) acc[j] = x0[j];
      for (int64_t u = 1; u < g.kh; ++u) {
        const T* xu = x0 + u * g.w;
        if (mode == PoolMode::Max) {
          for (int64_t j = 0; j < span; ++j) acc[j] = max_nan(acc[j], xu[j]);
        } else {
          for (int64_t j = 0; j < span; ++j) acc[j] += xu[j];
        }
      }
      T* yp = y + (pl * g.p + p) * g.q;
      for (int64_t q = 0; q < g.q; ++q) {
        const T* a = acc + q * g.kw;
        T r = a[0];
        for (int64_t v = 1; v < g.kw; ++v) r = mode == PoolMode::Max ? max_nan(r, a[v]) : r + a[v];
        yp[q] = mode == PoolMode::Max ? r : r * inv_area;
      }
    }
  }
}

// Avg backward of a tiling pool: each input gets its window's dy / area; the few inputs no
// window covers (the bottom rows and right columns that do not fill a window) get 0.
template <typename T>
void avg_pool_backward_tiled(const PoolGeom& g, const T* dy, T* dx) {
  const T inv_area = T(1) / static_cast<T>(g.kh * g.kw);
  const int64_t span = g.q * g.kw, covered_rows = g.p * g.kh;
  std::vector<T> shares(static_cast<size_t>(span));  // one output row's dy / area, widened
  for (int64_t pl = 0; pl < g.planes; ++pl) {
    T* plane = dx + pl * g.h * g.w;
    for (int64_t p = 0; p < g.p; ++p) {
      const T* d = dy + (pl * g.p + p) * g.q;
      for (int64_t q = 0; q < g.q; ++q) {
        for (int64_t v = 0; v < g.kw; ++v) shares[q * g.kw + v] = d[q] * inv_area;
      }
      for (int64_t u = 0; u < g.kh; ++u) {
        T* row = plane + (p * g.kh + u) * g.w;
        for (int64_t j = 0; j < span; ++j) row[j] = shares[j];
        if (span < g.w) std::fill(row + span, row + g.w, T(0));
      }
    }
    if (covered_rows < g.h) std::fill(plane + covered_rows * g.w, plane + g.h * g.w, T(0));
  }
}

template <typename T>
void pool_forward(PoolMode mode, const PoolGeom& g, const T* x, T* y) {
  if (tiles(g)) return pool_forward_tiled(mode, g, x, y);
  // count_include_pad: the divisor is the full window (see Pool2dParams).
  const T inv_area = T(1) / static_cast<T>(g.kh * g.kw);
  for (int64_t pl = 0; pl < g.planes; ++pl) {
    const T* xp = x + pl * g.h * g.w;
    T* yp = y + pl * g.p * g.q;
    for (int64_t p = 0; p < g.p; ++p) {
      for (int64_t q = 0; q < g.q; ++q) {
        const Window win = window(g, p, q);
        if (mode == PoolMode::Max) {
          yp[p * g.q + q] = win.h0 < win.h1 && win.w0 < win.w1
                                ? xp[argmax_window(xp, g, win)]
                                : -std::numeric_limits<T>::infinity();
        } else {
          acc_t<T> s = 0;
          for (int64_t h = win.h0; h < win.h1; ++h) {
            for (int64_t w = win.w0; w < win.w1; ++w) s += xp[h * g.w + w];
          }
          yp[p * g.q + q] = static_cast<T>(s) * inv_area;
        }
      }
    }
  }
}

template <typename T>
void pool_backward(PoolMode mode, const PoolGeom& g, const T* x, const T* dy, T* dx) {
  if (mode == PoolMode::Avg && tiles(g)) return avg_pool_backward_tiled(g, dy, dx);
  const T inv_area = T(1) / static_cast<T>(g.kh * g.kw);
  std::fill(dx, dx + g.planes * g.h * g.w, T(0));
  for (int64_t pl = 0; pl < g.planes; ++pl) {
    const T* xp = x + pl * g.h * g.w;
    const T* dyp = dy + pl * g.p * g.q;
    T* dxp = dx + pl * g.h * g.w;
    for (int64_t p = 0; p < g.p; ++p) {
      for (int64_t q = 0; q < g.q; ++q) {
        const Window win = window(g, p, q);
        if (win.h0 >= win.h1 || win.w0 >= win.w1) continue;
        const T d = dyp[p * g.q + q];
        if (mode == PoolMode::Max) {
          dxp[argmax_window(xp, g, win)] += d;
        } else {
          const T share = d * inv_area;
          for (int64_t h = win.h0; h < win.h1; ++h) {
            for (int64_t w = win.w0; w < win.w1; ++w) dxp[h * g.w + w] += share;
          }
        }
      }
    }
  }
}

}  // namespace

void CpuBackend::pool2d_forward(PoolMode mode, const Tensor& x, const Pool2dParams& p,
                                const Tensor& y) {
  const PoolGeom g = geom(x, y, p);
  dispatch_floating(x.dtype(), "pool2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    pool_forward<T>(mode, g, static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()));
  });
}

void CpuBackend::pool2d_backward(PoolMode mode, const Tensor& x, const Tensor& y, const Tensor& dy,
                                 const Pool2dParams& p, const Tensor& dx) {
  const PoolGeom g = geom(x, dy, p);
  dispatch_floating(x.dtype(), "pool2d_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    pool_backward<T>(mode, g, static_cast<const T*>(x.raw_data()),
                     static_cast<const T*>(dy.raw_data()), static_cast<T*>(dx.raw_data()));
  });
}

}  // namespace tandem::cpu
