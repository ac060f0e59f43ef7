#pragma once
// What the row-window kernels' two files share (Note [row convolution] in conv_rows.cu): the
// limits, the device helpers for staging rows through shared memory, and the checks that
// row_conv_fits (conv_rows.cu) asks of the weight-gradient file (conv_rows_wgrad.cu).
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_rows.h"

namespace tandem::gpu::row_detail {

constexpr int kMaxRowThreads = 256;     // threads of a forward / input-gradient block
constexpr int kMaxWgradTapThreads = 384;  // tap threads of a weight-gradient block
constexpr int kWgradKTile = 8;          // output channels per weight-gradient thread (KT)
constexpr int64_t kMaxRowTaps = 512;    // input channels * R * S of one output
constexpr int64_t kMaxRowFilterRows = 7;
constexpr int64_t kMaxSharedBytes = 48 * 1024;
constexpr int kColumnTiles[] = {8, 7, 5, 4};  // the QC instantiated, preferred first on ties

// ---- device helpers ---------------------------------------------------------------------

// N consecutive elements of shared memory into registers, in 16-byte (or 8-byte) loads; the
// address is a multiple of N elements from a 16-byte aligned base.
template <int N, typename T>
__device__ __forceinline__ void load_vec(const T* src, T (&v)[N]) {
  if constexpr (std::is_same_v<T, float> && N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 a = reinterpret_cast<const float4*>(src)[i / 4];
      v[i] = a.x, v[i + 1] = a.y, v[i + 2] = a.z, v[i + 3] = a.w;
    }
  } else if constexpr (std::is_same_v<T, float> && N == 2) {
    const float2 a = reinterpret_cast<const float2*>(src)[0];
    v[0] = a.x, v[1] = a.y;
  } else if constexpr (std::is_same_v<T, double> && N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const double2 a = reinterpret_cast<const double2*>(src)[i / 2];
      v[i] = a.x, v[i + 1] = a.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = src[i];
  }
}

inline int round4(int64_t v) { return static_cast<int>(ceil_div(v, 4) * 4); }

// The layout checks every row kernel makes (conv_rows.cu): the own kernels' conditions
// (own_conv_kernels_take) and padding narrower than the filter.
bool shapes_fit(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p);
// Whether the weight-gradient kernel takes x [N, C, H, W], w [K, C, R, S] -> y [N, K, P, Q]
// with elements of `elem` bytes (conv_rows_wgrad.cu).
bool wgrad_fits(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p, bool with_bias,
                int64_t elem);

}  // namespace tandem::gpu::row_detail
