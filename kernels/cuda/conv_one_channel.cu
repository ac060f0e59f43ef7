// The one-input-channel convolution's forward, and which layers these kernels take (Note
// [one-input-channel convolution] in conv_one_channel.cuh).
#include "kernels/cuda/conv_one_channel.cuh"

namespace tandem::gpu {

namespace {

using namespace one_channel;

// ---- forward ----------------------------------------------------------------------------------

template <typename T, typename TapsT, bool kLast>
__global__ void __launch_bounds__(kThreads, 2)
    one_channel_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                               T* __restrict__ y, OneShape g) {
  using A = opmath_t<T>;
  constexpr int RM = TapsT::rm, SM = TapsT::sm;
  constexpr bool kExact = TapsT::exact;
  constexpr int CPT = channels_per_thread(RM, SM, sizeof(A));
  extern __shared__ __align__(16) unsigned char one_channel_smem[];
  A* const tile = reinterpret_cast<A*>(one_channel_smem);
  A* const filt = tile + g.tile_elems;  // [R * S][gb * CPT]
  const Place pl = place_of<kLast>(g);
  const int r = kExact ? RM : g.r, s = kExact ? SM : g.s;
  const int rs = r * s, kb = g.gb * CPT;
  stage_tile(x + static_cast<int64_t>(pl.img) * g.h * g.w, tile, g, pl.row0, pl.row1);
  for (int i = threadIdx.x; i < rs * kb; i += kThreads) {
    const int kk = i / rs, tap = i - kk * rs;  // w read in its own order
    const int ko = pl.k_first + kk;
    filt[tap * kb + kk] = ko < g.k ? static_cast<A>(w[static_cast<int64_t>(ko) * rs + tap]) : A(0);
  }
  __syncthreads();
  if (pl.k0 >= g.k) return;  // a group past K (K is a multiple of CPT): no barrier follows
  A wr[RM][SM][CPT];
#pragma unroll
  for (int rr = 0; rr < RM; ++rr) {
#pragma unroll
    for (int ss = 0; ss < SM; ++ss) {
      if (kExact || (rr < r && ss < s)) {
        load_channels(filt + (rr * s + ss) * kb + pl.group * CPT, wr[rr][ss]);
      } else {
#pragma unroll
        for (int c = 0; c < CPT; ++c) wr[rr][ss][c] = A(0);
      }
    }
  }
  A b[CPT];
#pragma unroll
  for (int c = 0; c < CPT; ++c) b[c] = bias != nullptr ? static_cast<A>(bias[pl.k0 + c]) : A(0);
  const int pq = g.p * g.q;
  for (int pix = pl.pix0 + pl.slot; pix < pl.pix1; pix += g.slots) {
    A acc[CPT];
#pragma unroll
    for (int c = 0; c < CPT; ++c) acc[c] = A(0);
    for_each_tap<RM, SM, kExact>(tile, g, pl, pix, r, s, [&](int rr, int ss, A v) {
#pragma unroll
      for (int c = 0; c < CPT; ++c) acc[c] = fma(wr[rr][ss][c], v, acc[c]);
    });
    if (bias != nullptr) {
#pragma unroll
      for (int c = 0; c < CPT; ++c) acc[c] += b[c];
    }
    if constexpr (kLast) {
      store_group<CPT>(y + (static_cast<int64_t>(pl.img) * pq + pix) * g.k + pl.k0, acc);
    } else {
      T* o = y + (static_cast<int64_t>(pl.img) * g.k + pl.k0) * pq + pix;
#pragma unroll
      for (int c = 0; c < CPT; ++c) o[static_cast<int64_t>(c) * pq] = round_to<T>(acc[c]);
    }
  }
}

}  // namespace

bool one_channel_conv_applies(OneChannelPass pass, const Tensor& x, const Tensor& w, const Tensor& y,
                              const Conv2dParams& p) {
  constexpr int64_t kMax32 = int64_t{1} << 31;
  if (!one_channel_conv()) return false;
  if (x.dim() != 4 || w.dim() != 4 || y.dim() != 4) return false;
  const DType dt = x.dtype();
  if (dt != kBFloat16 && dt != kFloat32 && dt != kFloat64) return false;
  const bool wide_dw = pass == OneChannelPass::BackwardWeight && dt == kBFloat16 && w.dtype() == kFloat32;
  if (y.dtype() != dt || (w.dtype() != dt && !wide_dw)) return false;
  if (x.size(1) != 1 || w.size(1) != 1 || w.size(2) > kMaxTaps || w.size(3) > kMaxTaps) return false;
  if (p.stride_h < 1 || p.stride_h > kMaxStride || p.stride_w < 1 || p.stride_w > kMaxStride) return false;
  // One channel: x and w address their elements alike in both formats; y in either.
  if (!x.is_contiguous() || !w.is_contiguous()) return false;
  if (!y.is_contiguous() && !y.is_contiguous(MemoryFormat::ChannelsLast)) return false;
  if (x.numel() >= kMax32 || y.numel() >= kMax32) return false;
  const OneShape g = shape_of(x, w, y, p, pass);
  if (g.k % g.cpt != 0) return false;
  const size_t elem = dtype_size(dt);
  if (!y.is_contiguous() && reinterpret_cast<uintptr_t>(y.raw_data()) % (g.cpt * elem) != 0) return false;
  const int64_t acc = dt == kFloat64 ? 8 : 4;
  return shared_elems(g, pass) * acc <= kMaxSharedBytes;
}

void one_channel_conv_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p,
                              const Tensor& y, cudaStream_t stream) {
  const OneShape g = shape_of(x, w, y, p, OneChannelPass::Forward);
  const bool last = !y.is_contiguous();
  dispatch_floating_bf16(x.dtype(), "conv2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = opmath_t<T>;
    const size_t shared = static_cast<size_t>(shared_elems(g, OneChannelPass::Forward)) * sizeof(A);
    const dim3 grid(static_cast<unsigned>(int64_t{g.n} * g.chunks), static_cast<unsigned>(g.group_blocks));
    with_kernel(g, last, [&](auto taps, auto cl) {
      using TapsT = decltype(taps);
      TANDEM_CHECK(g.cpt == channels_per_thread(TapsT::rm, TapsT::sm, sizeof(A)), Value,
                   "one_channel_conv_forward: channels per thread disagree");
      one_channel_forward_kernel<T, TapsT, decltype(cl)::value><<<grid, kThreads, shared, stream>>>(
          cptr<T>(x), cptr<T>(w), bias.defined() ? cptr<T>(bias) : nullptr, ptr<T>(y), g);
    });
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace tandem::gpu
