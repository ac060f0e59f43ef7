// 2-D convolution as im2col + GEMM over chunks of the batch.
//
// Note [conv as batched GEMM]: the columns of several images go into one buffer
//   cols [C*R*S, m*P*Q]   (row (c, r, s), column (n, p, q))
// so the forward is a single product w [K, C*R*S] @ cols -> [K, m*P*Q] per chunk of m images,
// followed by a cheap permute into y [m, K, P, Q]. Many images per GEMM keep OpenBLAS
// efficient even when P*Q is small (late layers) or K is small (LeNet's 6 channels), where
// per-image GEMMs would be dominated by call overhead. The chunk is sized to the L2 cache
// (kColBytes) rather than the whole batch: unfolding a whole LeNet batch writes 15-20 MB of
// columns that the GEMM then streams back from memory, and on LeNet's layers the cache-sized
// chunks (3-4 images, still one GEMM of ~2,500 columns each) ran 1.5-3x faster.
// Backward input is w^T @ dy -> columns, then col2im (scatter-add); backward weight is
// dy [K, m*P*Q] @ cols^T accumulated over chunks.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"

namespace tandem::cpu {

template <typename T>
T* scratch(int slot, size_t n) {
  // double storage keeps every element type aligned.
  thread_local std::vector<double> buffers[4];
  auto& buf = buffers[slot];
  const size_t need = (n * sizeof(T) + sizeof(double) - 1) / sizeof(double);
  if (buf.size() < need) {
    buf.clear();
    buf.shrink_to_fit();
    buf.resize(need);
  }
  return reinterpret_cast<T*>(buf.data());
}
template float* scratch<float>(int, size_t);
template double* scratch<double>(int, size_t);

namespace {

// Column bytes per chunk: small enough that the columns, the GEMM's packed copy of them and
// its output stay in the per-core L2 cache (Note [conv as batched GEMM]).
constexpr int64_t kColBytes = int64_t{256} << 10;

struct ConvGeom {
  int64_t n, c, h, w;  // input [N, C, H, W]
  int64_t k, r, s;     // weight [K, C, R, S]
  int64_t p, q;        // output [N, K, P, Q]
  int64_t sh, sw, ph, pw;
  int64_t crs() const { return c * r * s; }
  int64_t pq() const { return p * q; }
  // Images per chunk so that the column buffer stays under kColBytes (at least one image).
  int64_t chunk(size_t elem_size) const {
    const int64_t per_image = std::max<int64_t>(crs() * pq() * static_cast<int64_t>(elem_size), 1);
    return std::clamp<int64_t>(kColBytes / per_image, 1, std::max<int64_t>(n, 1));
  }
};

ConvGeom geom(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& prm) {
  return {x.size(0), x.size(1), x.size(2),    x.size(3),    w.size(0), w.size(2), w.size(3),
          y.size(2), y.size(3), prm.stride_h, prm.stride_w, prm.pad_h, prm.pad_w};
}

// Padded extents of the input: im2col and col2im work on a zero-padded copy, so their inner
// loops are plain row copies with no bounds checks (the padding is a border of real zeros).
inline int64_t padded_h(const ConvGeom& g) {
  return g.h + 2 * g.ph;
}
inline int64_t padded_w(const ConvGeom& g) {
  return g.w + 2 * g.pw;
}
inline bool has_padding(const ConvGeom& g) {
  return g.ph != 0 || g.pw != 0;
}

// Scratch for `chunk` padded images (null when there is no padding).
template <typename T>
T* padding_buffer(const ConvGeom& g, int64_t chunk) {
  if (!has_padding(g)) return nullptr;
  return scratch<T>(2, static_cast<size_t>(chunk * g.c * padded_h(g) * padded_w(g)));
}

// xp [m, C, H + 2ph, W + 2pw] from x [m, C, H, W]; x itself when there is no padding.
template <typename T>
const T* pad_input(const ConvGeom& g, const T* x, int64_t m, T* buf) {
  if (!has_padding(g)) return x;
  const int64_t hp = padded_h(g), wp = padded_w(g);
  std::fill(buf, buf + m * g.c * hp * wp, T(0));
  for (int64_t i = 0; i < m * g.c; ++i) {
    for (int64_t h = 0; h < g.h; ++h) {
      const T* src = x + (i * g.h + h) * g.w;
      std::copy(src, src + g.w, buf + (i * hp + h + g.ph) * wp + g.pw);
    }
  }
  return buf;
}

// cols [C*R*S, m*P*Q] from the padded input xp.
template <typename T>
void im2col(const ConvGeom& g, const T* xp, int64_t m, T* cols) {
  const int64_t hp = padded_h(g), wp = padded_w(g), ncols = m * g.pq();
  for (int64_t c = 0; c < g.c; ++c) {
    for (int64_t r = 0; r < g.r; ++r) {
      for (int64_t s = 0; s < g.s; ++s) {
        T* dst = cols + ((c * g.r + r) * g.s + s) * ncols;
        for (int64_t n = 0; n < m; ++n) {
          const T* src = xp + ((n * g.c + c) * hp + r) * wp + s;
          for (int64_t p = 0; p < g.p; ++p) {
            const T* sr = src + p * g.sh * wp;
            T* d = dst + (n * g.p + p) * g.q;
            if (g.sw == 1) {
              for (int64_t q = 0; q < g.q; ++q) d[q] = sr[q];
            } else {
              for (int64_t q = 0; q < g.q; ++q) d[q] = sr[q * g.sw];
            }
          }
        }
      }
    }
  }
}

// dxp [m, C, H + 2ph, W + 2pw] += scatter of cols [C*R*S, m*P*Q] (the adjoint of im2col).
template <typename T>
void col2im(const ConvGeom& g, const T* cols, int64_t m, T* dxp) {
  const int64_t hp = padded_h(g), wp = padded_w(g), ncols = m * g.pq();
  for (int64_t c = 0; c < g.c; ++c) {
    for (int64_t r = 0; r < g.r; ++r) {
      for (int64_t s = 0; s < g.s; ++s) {
        const T* src = cols + ((c * g.r + r) * g.s + s) * ncols;
        for (int64_t n = 0; n < m; ++n) {
          T* dst = dxp + ((n * g.c + c) * hp + r) * wp + s;
          for (int64_t p = 0; p < g.p; ++p) {
            T* dr = dst + p * g.sh * wp;
            const T* d = src + (n * g.p + p) * g.q;
            if (g.sw == 1) {
              for (int64_t q = 0; q < g.q; ++q) dr[q] += d[q];
            } else {
              for (int64_t q = 0; q < g.q; ++q) dr[q * g.sw] += d[q];
            }
          }
        }
      }
    }
  }
}

// dx [m, C, H, W] = the interior of the padded gradient dxp.
template <typename T>
void unpad(const ConvGeom& g, const T* dxp, int64_t m, T* dx) {
  const int64_t hp = padded_h(g), wp = padded_w(g);
  for (int64_t i = 0; i < m * g.c; ++i) {
    for (int64_t h = 0; h < g.h; ++h) {
      const T* src = dxp + (i * hp + h + g.ph) * wp + g.pw;
      std::copy(src, src + g.w, dx + (i * g.h + h) * g.w);
    }
  }
}

// dyp [K, m*P*Q] from dy [m, K, P, Q]: the GEMM layout of a chunk of output gradients.
template <typename T>
void gather_dy(const ConvGeom& g, const T* dy, int64_t m, T* dyp) {
  const int64_t pq = g.pq();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t k = 0; k < g.k; ++k) {
      std::memcpy(dyp + (k * m + i) * pq, dy + (i * g.k + k) * pq, pq * sizeof(T));
    }
  }
}

template <typename T>
void conv_forward(const ConvGeom& g, const T* x, const T* w, const T* bias, T* y) {
  const int64_t chunk = g.chunk(sizeof(T)), pq = g.pq(), crs = g.crs();
  T* cols = scratch<T>(0, static_cast<size_t>(crs * chunk * pq));
  T* tmp = scratch<T>(1, static_cast<size_t>(g.k * chunk * pq));
  T* pad = padding_buffer<T>(g, chunk);
  for (int64_t n0 = 0; n0 < g.n; n0 += chunk) {
    const int64_t m = std::min(chunk, g.n - n0);
    im2col(g, pad_input(g, x + n0 * g.c * g.h * g.w, m, pad), m, cols);
    gemm_raw(false, false, g.k, m * pq, crs, T(1), w, crs, cols, m * pq, T(0), tmp, m * pq);
    // tmp [K, m, P*Q] -> y [m, K, P*Q], adding the bias on the way.
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t k = 0; k < g.k; ++k) {
        const T* src = tmp + (k * m + i) * pq;
        T* dst = y + ((n0 + i) * g.k + k) * pq;
        const T b = bias ? bias[k] : T(0);
        for (int64_t j = 0; j < pq; ++j) dst[j] = src[j] + b;
      }
    }
  }
}

template <typename T>
void conv_backward_input(const ConvGeom& g, const T* dy, const T* w, T* dx) {
  const int64_t chunk = g.chunk(sizeof(T)), pq = g.pq(), crs = g.crs();
  T* dcols = scratch<T>(0, static_cast<size_t>(crs * chunk * pq));
  T* dyp = scratch<T>(1, static_cast<size_t>(g.k * chunk * pq));
  T* pad = padding_buffer<T>(g, chunk);
  for (int64_t n0 = 0; n0 < g.n; n0 += chunk) {
    const int64_t m = std::min(chunk, g.n - n0);
    gather_dy(g, dy + n0 * g.k * pq, m, dyp);
    // dcols [CRS, m*PQ] = w^T [CRS, K] @ dyp [K, m*PQ]
    gemm_raw(true, false, crs, m * pq, g.k, T(1), w, crs, dyp, m * pq, T(0), dcols, m * pq);
    T* dxm = dx + n0 * g.c * g.h * g.w;
    T* acc = has_padding(g) ? pad : dxm;
    std::fill(acc, acc + m * g.c * padded_h(g) * padded_w(g), T(0));
    col2im(g, dcols, m, acc);
    if (has_padding(g)) unpad(g, pad, m, dxm);
  }
}

template <typename T>
void conv_backward_weight(const ConvGeom& g, const T* x, const T* dy, T* dw) {
  const int64_t chunk = g.chunk(sizeof(T)), pq = g.pq(), crs = g.crs();
  T* cols = scratch<T>(0, static_cast<size_t>(crs * chunk * pq));
  T* dyp = scratch<T>(1, static_cast<size_t>(g.k * chunk * pq));
  T* pad = padding_buffer<T>(g, chunk);
  std::fill(dw, dw + g.k * crs, T(0));
  for (int64_t n0 = 0; n0 < g.n; n0 += chunk) {
    const int64_t m = std::min(chunk, g.n - n0);
    im2col(g, pad_input(g, x + n0 * g.c * g.h * g.w, m, pad), m, cols);
    gather_dy(g, dy + n0 * g.k * pq, m, dyp);
    // dw [K, CRS] += dyp [K, m*PQ] @ cols^T [m*PQ, CRS]
    gemm_raw(false, true, g.k, crs, m * pq, T(1), dyp, m * pq, cols, m * pq, T(1), dw, crs);
  }
}

// db [K] = the sum of dy [N, K, PQ] per channel, in double, image by image: an order that
// depends on dy's shape alone, so a batch norm that takes the bias (Note [conv bias in batch
// norm] in kernels/cuda/batchnorm.cuh) gets the same bits from its dx.
template <typename T>
void conv_backward_bias(const T* dy, int64_t n, int64_t k, int64_t pq, T* db) {
  for (int64_t c = 0; c < k; ++c) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T* row = dy + (i * k + c) * pq;
      for (int64_t j = 0; j < pq; ++j) s += row[j];
    }
    db[c] = static_cast<T>(s);
  }
}

template <typename T>
const T* ptr_or_null(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw_data()) : nullptr;
}

// Note [bfloat16 on the CPU]: the CPU is the reference, not a fast path, for bfloat16: a
// bfloat16 convolution or batch norm widens its operands to float32, runs the float32 kernel
// (float32 accumulation, as cuDNN's bfloat16 engines and tandem's CUDA kernels do) and rounds
// each result once.
Tensor widen(const Tensor& t) { return t.defined() ? t.to(kFloat32) : t; }

}  // namespace

void CpuBackend::conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias,
                                const Conv2dParams& p, const Tensor& y) {
  if (x.dtype() == kBFloat16) {  // Note [bfloat16 on the CPU]
    Tensor yf(y.shape(), kFloat32, y.device());
    conv2d_forward(widen(x), widen(w), widen(bias), p, yf);
    y.copy_(yf);
    return;
  }
  const ConvGeom g = geom(x, w, y, p);
  dispatch_floating(x.dtype(), "conv2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    conv_forward<T>(g, static_cast<const T*>(x.raw_data()), static_cast<const T*>(w.raw_data()),
                    ptr_or_null<T>(bias), static_cast<T*>(y.raw_data()));
  });
}

void CpuBackend::conv2d_backward_input(const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                                       const Tensor& dx) {
  if (dy.dtype() == kBFloat16) {
    Tensor dxf(dx.shape(), kFloat32, dx.device());
    conv2d_backward_input(widen(dy), widen(w), p, dxf);
    dx.copy_(dxf);
    return;
  }
  const ConvGeom g = geom(dx, w, dy, p);
  dispatch_floating(dy.dtype(), "conv2d_backward_input", [&](auto tag) {
    using T = typename decltype(tag)::type;
    conv_backward_input<T>(g, static_cast<const T*>(dy.raw_data()),
                           static_cast<const T*>(w.raw_data()), static_cast<T*>(dx.raw_data()));
  });
}

void CpuBackend::conv2d_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p,
                                        const Tensor& dw, const Tensor& db) {
  if (x.dtype() == kBFloat16) {
    Tensor dwf(dw.shape(), kFloat32, dw.device());
    Tensor dbf = db.defined() ? Tensor(db.shape(), kFloat32, db.device()) : Tensor();
    conv2d_backward_weight(widen(x), widen(dy), p, dwf, dbf);
    dw.copy_(dwf);
    if (db.defined()) db.copy_(dbf);
    return;
  }
  const ConvGeom g = geom(x, dw, dy, p);
  dispatch_floating(x.dtype(), "conv2d_backward_weight", [&](auto tag) {
    using T = typename decltype(tag)::type;
    conv_backward_weight<T>(g, static_cast<const T*>(x.raw_data()),
                            static_cast<const T*>(dy.raw_data()), static_cast<T*>(dw.raw_data()));
  });
  if (db.defined()) conv2d_backward_bias(dy, db);
}

void CpuBackend::conv2d_backward_bias(const Tensor& dy, const Tensor& db) {
  if (dy.dtype() == kBFloat16) {  // Note [bfloat16 on the CPU], as conv2d_backward_weight
    Tensor dbf(db.shape(), kFloat32, db.device());
    conv2d_backward_bias(widen(dy), dbf);
    db.copy_(dbf);
    return;
  }
  const int64_t n = dy.size(0), k = dy.size(1);
  dispatch_floating(dy.dtype(), "conv2d_backward_bias", [&](auto tag) {
    using T = typename decltype(tag)::type;
    conv_backward_bias<T>(static_cast<const T*>(dy.raw_data()), n, k, n * k == 0 ? 0 : dy.numel() / (n * k),
                          static_cast<T*>(db.raw_data()));
  });
}

}  // namespace tandem::cpu
