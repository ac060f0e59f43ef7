// The one-input-channel convolution's weight gradient (Note [one-input-channel convolution] in
// conv_one_channel.cuh): partial sums per block of images, added in a fixed order.
#include "kernels/cuda/conv_one_channel.cuh"

namespace tandem::gpu {

namespace {

using namespace one_channel;

// ---- weight gradient --------------------------------------------------------------------------

// Block (image, pixel chunk; channel groups): partial[blockIdx.x][k][o] for its channels k and
// every slot o: tap r * S + s, then the bias when with_bias.
template <typename T, typename TapsT, bool kLast>
__global__ void __launch_bounds__(kThreads, 2)
    one_channel_wgrad_kernel(const T* __restrict__ x, const T* __restrict__ dy, opmath_t<T>* __restrict__ partial,
                             OneShape g, bool with_bias) {
  using A = opmath_t<T>;
  constexpr int RM = TapsT::rm, SM = TapsT::sm;
  constexpr bool kExact = TapsT::exact;
  constexpr int CPT = channels_per_thread(RM, SM, sizeof(A));
  extern __shared__ __align__(16) unsigned char one_channel_smem[];
  A* const tile = reinterpret_cast<A*>(one_channel_smem);
  A* const red = tile + g.tile_elems;  // [gb][(R * S + 1) * CPT]: slot-major, then channel
  const Place pl = place_of<kLast>(g);
  const int r = kExact ? RM : g.r, s = kExact ? SM : g.s;
  const int rs = r * s;
  stage_tile(x + static_cast<int64_t>(pl.img) * g.h * g.w, tile, g, pl.row0, pl.row1);
  __syncthreads();
  A acc[RM][SM][CPT], bsum[CPT];
#pragma unroll
  for (int rr = 0; rr < RM; ++rr) {
#pragma unroll
    for (int ss = 0; ss < SM; ++ss) {
#pragma unroll
      for (int c = 0; c < CPT; ++c) acc[rr][ss][c] = A(0);
    }
  }
#pragma unroll
  for (int c = 0; c < CPT; ++c) bsum[c] = A(0);
  // Pixels whose dy a thread loads before it multiplies the first: up to four, in
  // kAheadRegisters (a vector of CPT channels takes CPT * sizeof(T) / 4 registers channels-last;
  // CPT loads of one element take CPT registers or more NCHW); one for 7x7 filters, whose
  // unrolled taps spilled registers with more.
  constexpr int kPixelRegisters = kLast ? (CPT * static_cast<int>(sizeof(T)) + 3) / 4
                                        : CPT * ((static_cast<int>(sizeof(T)) + 3) / 4);
  constexpr int kUnroll = RM > 5 ? 1 : std::clamp(kAheadRegisters / kPixelRegisters, 1, 4);
  const int pq = g.p * g.q;
  const int step = g.slots;
  if (pl.k0 < g.k) {
    // dy of pixel pix, channels k0 .. k0 + CPT: one vector channels-last, CPT planes NCHW.
    const auto load = [&](int pix) {
      Vec<T, CPT> d;
      if constexpr (kLast) {
        d = *reinterpret_cast<const Vec<T, CPT>*>(dy + (static_cast<int64_t>(pl.img) * pq + pix) * g.k + pl.k0);
      } else {
        const T* src = dy + (static_cast<int64_t>(pl.img) * g.k + pl.k0) * pq + pix;
#pragma unroll
        for (int c = 0; c < CPT; ++c) d.v[c] = src[static_cast<int64_t>(c) * pq];
      }
      return d;
    };
    for (int base = pl.pix0 + pl.slot; base < pl.pix1; base += kUnroll * step) {
      Vec<T, CPT> raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * step < pl.pix1) raw[u] = load(base + u * step);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int pix = base + u * step;
        if (pix >= pl.pix1) break;
        A d[CPT];
        widen(raw[u], d);
        for_each_tap<RM, SM, kExact>(tile, g, pl, pix, r, s, [&](int rr, int ss, A v) {
#pragma unroll
          for (int c = 0; c < CPT; ++c) acc[rr][ss][c] = fma(d[c], v, acc[rr][ss][c]);
        });
        if (with_bias) {
#pragma unroll
          for (int c = 0; c < CPT; ++c) bsum[c] += d[c];
        }
      }
    }
  }
  // The threads of a group, in a fixed order: a shuffle tree over the lanes of a warp that hold
  // the group (channels-last lanes gb apart; NCHW the whole warp), then the warps in turn.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int mask = kLast ? g.gb : 1; mask < 32; mask *= 2) {
#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
#pragma unroll
      for (int ss = 0; ss < SM; ++ss) {
        if (kExact || (rr < r && ss < s)) {
#pragma unroll
          for (int c = 0; c < CPT; ++c) acc[rr][ss][c] += __shfl_xor_sync(0xffffffffu, acc[rr][ss][c], mask);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < CPT; ++c) bsum[c] += __shfl_xor_sync(0xffffffffu, bsum[c], mask);
  }
  const int warps_per_group = kLast ? kThreads / 32 : g.slots / 32;
  const int turn = kLast ? warp : warp % warps_per_group;
  const bool holder = kLast ? lane < g.gb : lane == 0;
  const int per_group = (rs + 1) * CPT;
  A* const mine = red + pl.group * per_group;
  for (int t = 0; t < warps_per_group; ++t) {
    if (holder && turn == t) {
#pragma unroll
      for (int rr = 0; rr < RM; ++rr) {
#pragma unroll
        for (int ss = 0; ss < SM; ++ss) {
          if (kExact || (rr < r && ss < s)) {
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
              A& slot = mine[(rr * s + ss) * CPT + c];
              slot = t == 0 ? acc[rr][ss][c] : slot + acc[rr][ss][c];
            }
          }
        }
      }
#pragma unroll
      for (int c = 0; c < CPT; ++c) {
        A& slot = mine[rs * CPT + c];
        slot = t == 0 ? bsum[c] : slot + bsum[c];
      }
    }
    __syncthreads();
  }
  const int slots_out = rs + (with_bias ? 1 : 0);
  const int kb = g.gb * CPT;
  for (int i = threadIdx.x; i < kb * slots_out; i += kThreads) {
    const int kk = i / slots_out, o = i - kk * slots_out;
    const int ko = pl.k_first + kk;
    if (ko < g.k) {
      partial[(static_cast<int64_t>(blockIdx.x) * g.k + ko) * slots_out + o] =
          red[(kk / CPT) * per_group + o * CPT + kk % CPT];
    }
  }
}

// dw[k, o] (and db[k]) = the blocks' partial sums in double, rounded once to Out: a warp per
// output, lane i adding blocks i, i + 32, ..., then the lanes in a fixed tree.
template <typename A, typename Out>
__global__ void one_channel_wgrad_finish(const A* __restrict__ partial, Out* __restrict__ dw, Out* __restrict__ db,
                                         int k, int slots, int taps, int blocks) {
  const int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (i >= k * slots) return;  // a whole warp leaves together
  double sum = 0;
  for (int j = lane; j < blocks; j += 32) {
    sum += static_cast<double>(partial[static_cast<int64_t>(j) * k * slots + i]);
  }
  for (int d = 16; d > 0; d /= 2) sum += __shfl_down_sync(0xffffffffu, sum, d);
  if (lane != 0) return;
  const int ko = i / slots, o = i - ko * slots;
  if (o < taps) {
    dw[ko * taps + o] = static_cast<Out>(sum);
  } else {
    db[ko] = static_cast<Out>(sum);
  }
}

}  // namespace

void one_channel_conv_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p, const Tensor& dw,
                                      const Tensor& db, cudaStream_t stream) {
  const bool with_bias = db.defined();
  TANDEM_CHECK(!with_bias || db.dtype() == dw.dtype(), DType, "one_channel_conv_backward_weight: db is ",
               dtype_name(db.dtype()), ", dw ", dtype_name(dw.dtype()));
  const OneShape g = shape_of(x, dw, dy, p, OneChannelPass::BackwardWeight);
  const bool last = !dy.is_contiguous();
  const int taps = g.r * g.s, slots = taps + (with_bias ? 1 : 0);
  const int64_t blocks = int64_t{g.n} * g.chunks;
  dispatch_floating_bf16(x.dtype(), "conv2d_backward_weight", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = opmath_t<T>;
    Tensor partial = empty({blocks * g.k * slots}, dtype_of<A>::value, dw.device());
    const size_t shared = static_cast<size_t>(shared_elems(g, OneChannelPass::BackwardWeight)) * sizeof(A);
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(g.group_blocks));
    with_kernel(g, last, [&](auto taps_t, auto cl) {
      using TapsT = decltype(taps_t);
      TANDEM_CHECK(g.cpt == channels_per_thread(TapsT::rm, TapsT::sm, sizeof(A)), Value,
                   "one_channel_conv_backward_weight: channels per thread disagree");
      one_channel_wgrad_kernel<T, TapsT, decltype(cl)::value><<<grid, kThreads, shared, stream>>>(
          cptr<T>(x), cptr<T>(dy), ptr<A>(partial), g, with_bias);
    });
    TANDEM_CUDA_CHECK_LAUNCH();
    constexpr int kFinishWarps = 8;
    const unsigned finish_blocks = static_cast<unsigned>(ceil_div(int64_t{g.k} * slots, kFinishWarps));
    const auto finish = [&](auto out_tag) {
      using Out = typename decltype(out_tag)::type;
      one_channel_wgrad_finish<A, Out><<<finish_blocks, kFinishWarps * 32, 0, stream>>>(
          cptr<A>(partial), ptr<Out>(dw), with_bias ? ptr<Out>(db) : nullptr, g.k, slots, taps,
          static_cast<int>(blocks));
      TANDEM_CUDA_CHECK_LAUNCH();
    };
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (dw.dtype() == kFloat32) {
        finish(TypeTag<float>{});
        return;
      }
    }
    finish(TypeTag<T>{});
  });
}

}  // namespace tandem::gpu
