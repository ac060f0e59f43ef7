// Batch normalization over [N, C, H*W] (H*W = 1 for [N, C] inputs), or over a channels-last
// [N * H * W, C] (Note [channels-last channel reductions]), per channel, with own
// kernels that follow kernels/cpu/batchnorm.cpp: statistics in double (Note [a thread's sums in
// float] for a 16-bit channels-last tensor), the biased variance for
// normalizing, the unbiased one for running_var.
//
// Each pass is three launches (Note [split channel reductions] in channel_reduce.cuh):
// partial sums of every (channel, image group) block, a per-channel finish that turns them
// into the channel's coefficients, and an elementwise pass that applies them. The variance is
// computed from sums of d = x - K and d^2 with K a sample of the channel (the shifted-data
// algorithm): one pass over x, in double, without the cancellation of E[x^2] - E[x]^2.
//
// Note [conv bias in batch norm]: in a ResNet, every convolution but the 1x1 shortcuts is
// followed by a batch norm. As two ops, the convolution's bias is one more pass over each
// activation forward (AddBias in conv.cu: read y, write y + b) and one backward (the bias
// gradient: read dy, the batch norm's dx, once more to sum it per channel) -- ~290 us of a
// 4.6 ms ResNet-18 step on an H200 (fused: 62.9k -> 64.6k images/s channels-last bf16, 31.5k ->
// 32.5k float32; on by default, fuse_conv_bias() in kernels/backend.h). Fused (a `bias` given to these kernels), the convolution
// writes z without its bias and every kernel here that reads x reads z instead and forms
// x = z + b[c] in registers with AddBias's own add (add_conv_bias: in the activation type T,
// so a bfloat16 sum is rounded once as there): the statistics and their shift K = x[c, first],
// the running statistics, the apply pass (with the ReLU or without), and in the backward the
// gradient partials and the dx pass. The saved tensor is z (and b), never z + b. The dx pass,
// which writes dx anyway, also sums it: db, the bias gradient, is channel_map_sum_any
// (channel_any.cuh), which walks the elements with the split, vector width and order of
// the convolution's bias reduction (channel_sum_any) and adds each rounded T value it stores,
// in double -- so db is bit for bit what the convolution computes from dx, and the outputs,
// statistics and every other gradient are those of the two ops. Mathematically a bias before
// a training-mode batch norm cancels (the mean absorbs it, and the sum of dx is zero up to
// rounding); but dropping it would change the bits, the running mean and eval mode, so the
// fusion keeps the arithmetic and only drops the memory passes. One exception: the layers
// of Note [direct convolution] (few input channels, packed NCHW float32/float64, e.g. a
// ResNet's stem) sum their bias gradient as one more tap of their weight-gradient kernel, in
// T; there the fused db (summed in double) differs from theirs in the last bits. The CPU, the
// reference, adds the bias in a pass of its own and sums db with the convolution's routine.
#include "core/device.h"
#include "kernels/cuda/channel_any.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tandem {

namespace gpu {
namespace {

// a * b + c rounded once. The maps and the partial sums below spell out their fused
// multiply-adds: left to the compiler, the contraction of the same expression can differ
// between two kernels that inline it (a ReLU mask around it, say, or a conv's bias), and the
// fused batch norm + ReLU and the fused conv bias must give the unfused ops' bits (Note [batch
// norm + ReLU] in kernels/backend.h, Note [conv bias in batch norm]).
template <typename P>
__device__ __forceinline__ P fma_p(P a, P b, P c) {
  if constexpr (std::is_same_v<P, double>) {
    return __fma_rn(a, b, c);
  } else {
    return __fmaf_rn(a, b, c);
  }
}

// x = z + b in T: the add of AddBias in conv.cu (Note [conv bias in batch norm]).
template <typename T>
__device__ __forceinline__ T add_conv_bias(T z, T b) {
  return z + b;
}

// The partial kernels' x from what they read: z + b of channel c when a conv's bias is fused
// in (bias not null), else z itself.
template <typename T>
struct ChannelBias {
  bool on;
  T b;
  __device__ T operator()(T z) const { return on ? add_conv_bias(z, b) : z; }
};
template <typename T>
__device__ __forceinline__ ChannelBias<T> channel_bias(const T* bias, int64_t c) {
  return bias != nullptr ? ChannelBias<T>{true, bias[c]} : ChannelBias<T>{false, T(0)};
}

// Channels-last partials, in the layout of the NCHW kernels' (Note [channels-last channel
// reductions]): sums of d and d^2, d = x - x[c] (the same sample K as bn_stats_partials).
template <typename T>
struct BnStatsLast {
  using sum_type = thread_sum_t<T>;  // Note [a thread's sums in float]
  const T* x;
  const T* bias;  // null: none (Note [conv bias in batch norm])
  template <int VEC>
  struct Channels {  // channels c0 .. c0 + VEC: their biases and shifts K, loaded once per thread
    const T* x;
    ChannelBias<T> b[VEC];
    sum_type k[VEC];
    __device__ Vec<T, VEC> load(int64_t i) const { return load_vec<VEC>(x, i); }
    __device__ void add(int64_t, const Vec<T, VEC>& v, sum_type (&sums)[VEC][2]) const {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const sum_type d = static_cast<sum_type>(b[j](v.v[j])) - k[j];
        sums[j][0] += d;
        sums[j][1] = fma_p(d, d, sums[j][1]);
      }
    }
  };
  template <int VEC>
  __device__ Channels<VEC> at(int64_t c0) const {
    Channels<VEC> a;
    a.x = x;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      a.b[j] = channel_bias(bias, c0 + j);
      a.k[j] = static_cast<sum_type>(a.b[j](x[c0 + j]));
    }
    return a;
  }
};

// dy masked by the fused ReLU's output (Note [batch norm + ReLU] in kernels/backend.h): the
// value the ReluBackward op would have written, without writing it.
template <typename T>
__device__ inline T relu_masked(T dy, T relu_out) {
  using C = opmath_t<T>;
  return static_cast<C>(relu_out) > C(0) ? dy : T(0);
}

// Sums of dy and dy * (x - mean), where dy is dy + dy_part when dy_part is not null (added as
// BinaryOp::Add adds: Note [gradient parts] in autograd/node.h), masked by relu_out when that is
// not null; with masked not null, that dy is also written there as it is added (Note [batch
// norm + residual join]).
template <typename T, typename P>
struct BnGradLast {
  using sum_type = thread_sum_t<T>;  // Note [a thread's sums in float]
  const T* dy;
  const T* x;
  const T* bias;
  const P* save_mean;
  const T* relu_out;
  T* masked;
  const T* dy_part;
  template <int VEC>
  struct Loaded {
    Vec<T, VEC> dy, x, relu_out, dy_part;
  };
  template <int VEC>
  struct Channels {  // channels c0 .. c0 + VEC: their biases and means, loaded once per thread
    const T* dy;
    const T* x;
    const T* relu_out;
    T* masked;
    const T* dy_part;
    ChannelBias<T> b[VEC];
    sum_type mean[VEC];
    __device__ Loaded<VEC> load(int64_t i) const {  // loads only (channel_partials_last)
      Loaded<VEC> l;
      l.dy = load_vec<VEC>(dy, i);
      l.x = load_vec<VEC>(x, i);
      if (relu_out != nullptr) l.relu_out = load_vec<VEC>(relu_out, i);
      if (dy_part != nullptr) l.dy_part = load_vec<VEC>(dy_part, i);
      return l;
    }
    __device__ void add(int64_t i, const Loaded<VEC>& l, sum_type (&sums)[VEC][2]) const {
      using C = opmath_t<T>;
      Vec<T, VEC> g;  // dy (+ dy_part), masked by the ReLU's output
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const T d = dy_part != nullptr ? static_cast<T>(static_cast<C>(l.dy.v[j]) + static_cast<C>(l.dy_part.v[j]))
                                       : l.dy.v[j];
        g.v[j] = relu_out != nullptr ? relu_masked(d, l.relu_out.v[j]) : d;
      }
      if (masked != nullptr) *reinterpret_cast<Vec<T, VEC>*>(masked + i) = g;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const sum_type d = static_cast<sum_type>(g.v[j]);
        sums[j][0] += d;
        sums[j][1] = fma_p(d, static_cast<sum_type>(b[j](l.x.v[j])) - mean[j], sums[j][1]);
      }
    }
  };
  template <int VEC>
  __device__ Channels<VEC> at(int64_t c0) const {
    Channels<VEC> a;
    a.dy = dy;
    a.x = x;
    a.relu_out = relu_out;
    a.masked = masked;
    a.dy_part = dy_part;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      a.b[j] = channel_bias(bias, c0 + j);
      a.mean[j] = static_cast<sum_type>(save_mean[c0 + j]);
    }
    return a;
  }
};

// partial[(c * splits + s) * 2 + {0, 1}] = sums of d and d^2 over the group, d = x - x[c, first].
template <int VEC, typename T>
__global__ void bn_stats_partials(const T* x, const T* bias, double* partial, ChannelSplit g) {
  const int64_t c = blockIdx.x, s = blockIdx.y;
  const ChannelBias<T> b = channel_bias(bias, c);
  const double k = static_cast<double>(b(x[c * g.hw]));
  double s1 = 0, s2 = 0;
  for_channel_group<VEC>(g, c, s, [&](int64_t off) {
    const Vec<T, VEC> v = load_vec<VEC>(x, off);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const double d = static_cast<double>(b(v.v[j])) - k;
      s1 += d;
      s2 = fma_p(d, d, s2);
    }
  });
  s1 = block_reduce(s1, SumOp{}, 0.0);
  s2 = block_reduce(s2, SumOp{}, 0.0);
  if (threadIdx.x == 0) {
    partial[(c * g.splits + s) * 2] = s1;
    partial[(c * g.splits + s) * 2 + 1] = s2;
  }
}

// One warp per channel (lane 0 writes): mean, variance, running statistics, and coef[c * 3 + {0,1,2}] =
// (mean, gamma * invstd, beta) for the elementwise pass.
template <typename T, typename P>
__global__ void bn_stats_finish(const T* x, const T* bias, const double* partial, const P* gamma, const P* beta,
                                P* running_mean, P* running_var, double momentum, double eps,
                                P* save_mean, P* save_invstd, P* coef, ChannelSplit g) {
  // The channel's other inputs first, in flight with the partials (finish_channel).
  const int64_t c = finish_channel_index();
  const bool writes = c < g.c && threadIdx.x % 32 == 0;
  double shift = 0, gm = 0, rm = 0, rv = 0;
  P bt{};
  if (writes) {
    shift = static_cast<double>(channel_bias(bias, c)(x[c * g.hw]));
    gm = static_cast<double>(gamma[c]);
    bt = beta[c];
    rm = static_cast<double>(running_mean[c]);
    rv = static_cast<double>(running_var[c]);
  }
  double sums[2];
  finish_channel<2>(partial, g, sums);  // Note [finishing a split reduction]
  if (!writes) return;
  const double s1 = sums[0], s2 = sums[1];
  const double m = static_cast<double>(g.n * g.hw);
  const double dmean = s1 / m;
  const double var = fmax(s2 / m - dmean * dmean, 0.0);
  const double mean = shift + dmean;
  const double invstd = 1.0 / sqrt(var + eps);
  save_mean[c] = static_cast<P>(mean);
  save_invstd[c] = static_cast<P>(invstd);
  const double unbiased = m > 1 ? var * m / (m - 1) : var;
  running_mean[c] = static_cast<P>((1 - momentum) * rm + momentum * mean);
  running_var[c] = static_cast<P>((1 - momentum) * rv + momentum * unbiased);
  coef[c * 3] = static_cast<P>(mean);
  coef[c * 3 + 1] = static_cast<P>(invstd * gm);
  coef[c * 3 + 2] = bt;
}

// y = (x - mean) * scale + shift with coef from bn_stats_finish.
// T is the activations' type, P the per-channel one (float for bfloat16 activations: they are
// computed in float and rounded once). Relu: then relu of the rounded value, as the ReLU op
// computes it (Note [batch norm + ReLU] in kernels/backend.h).
// Per-channel coefficients of a map: coef[c * N .. c * N + N), loaded at once (Note
// [per-channel maps] in channel_reduce.cuh).
template <typename P, int N>
struct ChannelCoef {
  P v[N];
};
template <int N, typename P>
__device__ __forceinline__ ChannelCoef<P, N> load_coef(const P* coef, int64_t c) {
  ChannelCoef<P, N> k;
#pragma unroll
  for (int j = 0; j < N; ++j) k.v[j] = coef[c * N + j];
  return k;
}

// A map's coefficients and, when the map is Biased, the channel's conv bias b: its x is then
// add_conv_bias(z, b) of the z it reads (Note [conv bias in batch norm]).
template <typename P, int N, typename T>
struct BnCoef {
  ChannelCoef<P, N> k;
  T b;
};
template <bool Biased, int N, typename P, typename T>
__device__ __forceinline__ BnCoef<P, N, T> load_bn_coef(const P* coef, const T* bias, int64_t c) {
  return {load_coef<N>(coef, c), Biased ? bias[c] : T(0)};
}
template <bool Biased, typename T>
__device__ __forceinline__ T bn_input(T z, T b) {
  if constexpr (Biased) {
    return add_conv_bias(z, b);
  } else {
    return z;
  }
}

template <typename T, typename P, bool Relu, bool Biased>
struct BnApply {
  const P* coef;  // (mean, scale, shift) per channel
  const T* bias;  // with Biased: the conv's
  __device__ BnCoef<P, 3, T> coef_of(int64_t c) const { return load_bn_coef<Biased, 3>(coef, bias, c); }
  __device__ T operator()(const BnCoef<P, 3, T>& kb, T z) const {
    const ChannelCoef<P, 3>& k = kb.k;
    const T x = bn_input<Biased>(z, kb.b);
    const T y = static_cast<T>(fma_p(static_cast<P>(x) - k.v[0], k.v[1], k.v[2]));
    if constexpr (Relu) {
      using C = opmath_t<T>;
      const C v = static_cast<C>(y);
      return static_cast<T>(v > C(0) ? v : C(0));
    }
    return y;
  }
};

// Note [batch norm + residual join]: a ResNet block ends in relu(bn2(conv2(...)) + shortcut).
// As two ops that is batch norm's apply pass (read z, write y) and the join (read y and the
// shortcut, write the sum's ReLU): y is written and read once more than it needs to be, ~18 us of
// a stage-1 block's forward on an H100. Fused, the apply pass reads the shortcut beside z and
// writes relu(y + shortcut) straight away, with AddRelu's own arithmetic (the batch-norm value
// rounded to T, the sum rounded to T, then the ReLU), so the output is the same bits. The
// backward is the join's ReluBackward -- the masked gradient, which is the shortcut's gradient
// too -- and batch norm's backward on it. As two ops that is a pass of its own (read dy and the
// output, write the masked dy) before batch norm's two passes read the masked dy: instead, channels-last,
// batch norm's partial sums mask dy as they read it (as after a plain batch norm + ReLU) and
// write the masked dy out for the shortcut, and the dx pass reads that; NCHW keeps the pass of
// its own (kernels::batch_norm_backward's masked_dy). The values are the same bits either way.
// The CPU, the reference, applies the batch norm and then the join's own kernel, and masks dy
// in a pass of its own.
template <typename T, typename P, bool Biased>
struct BnApplyAddRelu {
  const P* coef;  // (mean, scale, shift) per channel
  const T* bias;  // with Biased: the conv's
  __device__ BnCoef<P, 3, T> coef_of(int64_t c) const { return load_bn_coef<Biased, 3>(coef, bias, c); }
  __device__ T operator()(const BnCoef<P, 3, T>& kb, T z, T residual) const {
    using C = opmath_t<T>;
    const T y = BnApply<T, P, false, Biased>{coef, bias}(kb, z);
    const C s = static_cast<C>(static_cast<T>(static_cast<C>(y) + static_cast<C>(residual)));  // AddRelu's
    return static_cast<T>(s > C(0) ? s : C(0));
  }
};

// Calls f(std::bool_constant<on>) with on = bias.defined(): a kernel templated on whether a
// conv's bias is fused in.
template <typename F>
void with_bias(const Tensor& bias, F f) {
  if (bias.defined()) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// The apply pass, with the ReLU or without, on x, or on z + bias with x = z; with a residual,
// relu(y + residual) (Note [batch norm + residual join]).
template <typename T, typename P>
void bn_apply(const Tensor& x, const Tensor& bias, const Tensor& coef, const Tensor& y, bool relu,
              cudaStream_t stream, const Tensor& residual = Tensor()) {
  const T* b = bias.defined() ? cptr<T>(bias) : nullptr;
  with_bias(bias, [&](auto biased) {
    constexpr bool kBiased = decltype(biased)::value;
    if (residual.defined()) {
      channel_map_any(x, BnApplyAddRelu<T, P, kBiased>{cptr<P>(coef), b}, ptr<T>(y), stream, cptr<T>(x),
                      cptr<T>(residual));
    } else if (relu) {
      channel_map_any(x, BnApply<T, P, true, kBiased>{cptr<P>(coef), b}, ptr<T>(y), stream, cptr<T>(x));
    } else {
      channel_map_any(x, BnApply<T, P, false, kBiased>{cptr<P>(coef), b}, ptr<T>(y), stream, cptr<T>(x));
    }
  });
}

// y = (x - running_mean) * scale + shift with coef from bn_eval_coef (the same form as training).
template <typename P>
__global__ void bn_eval_coef(const P* gamma, const P* beta, const P* running_mean, const P* running_var,
                             double eps, P* coef, int64_t channels) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const double invstd = 1.0 / sqrt(static_cast<double>(running_var[c]) + eps);
  coef[c * 3] = running_mean[c];
  coef[c * 3 + 1] = static_cast<P>(invstd * static_cast<double>(gamma[c]));
  coef[c * 3 + 2] = beta[c];
}

// partial[(c * splits + s) * 2 + {0, 1}] = sums of dy and dy * (x - mean) over the group
// (dy masked by relu_out when it is not null).
template <int VEC, typename T, typename P>
__global__ void bn_grad_partials(const T* dy, const T* x, const T* bias, const P* save_mean, const T* relu_out,
                                 double* partial, ChannelSplit g) {
  const int64_t c = blockIdx.x, s = blockIdx.y;
  const double mean = static_cast<double>(save_mean[c]);
  const ChannelBias<T> b = channel_bias(bias, c);
  double sdy = 0, sdyx = 0;
  for_channel_group<VEC>(g, c, s, [&](int64_t off) {
    Vec<T, VEC> dv = load_vec<VEC>(dy, off);
    const Vec<T, VEC> xv = load_vec<VEC>(x, off);
    if (relu_out != nullptr) {
      const Vec<T, VEC> rv = load_vec<VEC>(relu_out, off);
#pragma unroll
      for (int j = 0; j < VEC; ++j) dv.v[j] = relu_masked(dv.v[j], rv.v[j]);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const double d = static_cast<double>(dv.v[j]);
      sdy += d;
      sdyx = fma_p(d, static_cast<double>(b(xv.v[j])) - mean, sdyx);
    }
  });
  sdy = block_reduce(sdy, SumOp{}, 0.0);
  sdyx = block_reduce(sdyx, SumOp{}, 0.0);
  if (threadIdx.x == 0) {
    partial[(c * g.splits + s) * 2] = sdy;
    partial[(c * g.splits + s) * 2 + 1] = sdyx;
  }
}

// With xhat = (x - mean) * invstd and M values per channel:
//   dbeta = sum(dy), dgamma = sum(dy * xhat),
//   dx = gamma * invstd / M * (M * dy - dbeta - xhat * dgamma) = a * dy + b * (x - mean) + d.
// coef[c * 4 + {0,1,2,3}] = (a, b, d, mean).
template <typename P>
__global__ void bn_grad_finish(const double* partial, const P* gamma, const P* save_mean,
                               const P* save_invstd, P* dgamma, P* dbeta, P* coef, ChannelSplit g) {
  // The channel's other inputs first, in flight with the partials (finish_channel).
  const int64_t c = finish_channel_index();
  const bool writes = c < g.c && threadIdx.x % 32 == 0;
  double invstd = 0, gm = 0;
  P mean{};
  if (writes) {
    invstd = static_cast<double>(save_invstd[c]);
    gm = static_cast<double>(gamma[c]);
    mean = save_mean[c];
  }
  double sums[2];
  finish_channel<2>(partial, g, sums);  // Note [finishing a split reduction]
  if (!writes) return;
  const double sdy = sums[0], sdyx = sums[1];
  const double m = static_cast<double>(g.n * g.hw);
  const double dg = sdyx * invstd;
  dbeta[c] = static_cast<P>(sdy);
  dgamma[c] = static_cast<P>(dg);
  const double k = gm * invstd / m;
  coef[c * 4] = static_cast<P>(k * m);
  coef[c * 4 + 1] = static_cast<P>(-k * dg * invstd);
  coef[c * 4 + 2] = static_cast<P>(-k * sdy);
  coef[c * 4 + 3] = mean;
}

template <typename T, typename P, bool Biased>
struct BnGradApply {
  const P* coef;  // (a, b, d, mean) per channel
  const T* bias;  // with Biased: the conv's
  __device__ BnCoef<P, 4, T> coef_of(int64_t c) const { return load_bn_coef<Biased, 4>(coef, bias, c); }
  __device__ T operator()(const BnCoef<P, 4, T>& kb, T dy, T z) const {
    const ChannelCoef<P, 4>& k = kb.k;
    const T x = bn_input<Biased>(z, kb.b);
    return static_cast<T>(fma_p(k.v[0], static_cast<P>(dy), fma_p(k.v[1], static_cast<P>(x) - k.v[3], k.v[2])));
  }
};

// The same with dy masked by the fused ReLU's output.
template <typename T, typename P, bool Biased>
struct BnReluGradApply {
  const P* coef;
  const T* bias;
  __device__ BnCoef<P, 4, T> coef_of(int64_t c) const { return load_bn_coef<Biased, 4>(coef, bias, c); }
  __device__ T operator()(const BnCoef<P, 4, T>& k, T dy, T z, T relu_out) const {
    return BnGradApply<T, P, Biased>{coef, bias}(k, relu_masked(dy, relu_out), z);
  }
};

// The dx pass: dx from dy and x (or z + bias with x = z), dy masked by relu_out when mask is not
// null; with dbias defined, also dbias = the per-channel sum of dx, in the same pass (Note
// [conv bias in batch norm]).
template <typename T, typename P>
void bn_grad_apply(const Tensor& x, const Tensor& bias, const Tensor& coef, const T* dy, const T* mask,
                   const Tensor& dx, const Tensor& dbias, cudaStream_t stream) {
  const T* b = bias.defined() ? cptr<T>(bias) : nullptr;
  const auto run = [&](const auto& f, const auto*... in) {
    if (dbias.defined()) {
      channel_map_sum_any(x, f, ptr<T>(dx), ptr<T>(dbias), stream, in...);
    } else {
      channel_map_any(x, f, ptr<T>(dx), stream, in...);
    }
  };
  with_bias(bias, [&](auto biased) {
    constexpr bool kBiased = decltype(biased)::value;
    if (mask != nullptr) {
      run(BnReluGradApply<T, P, kBiased>{cptr<P>(coef), b}, dy, cptr<T>(x), mask);
    } else {
      run(BnGradApply<T, P, kBiased>{cptr<P>(coef), b}, dy, cptr<T>(x));
    }
  });
}

unsigned channel_threads_grid(int64_t c) { return static_cast<unsigned>((c + kBlock - 1) / kBlock); }

}  // namespace
}  // namespace gpu

void CudaBackend::batch_norm_forward_train(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                                           const Tensor& beta, const Tensor& running_mean,
                                           const Tensor& running_var, double momentum, double eps,
                                           const Tensor& y, const Tensor& save_mean,
                                           const Tensor& save_invstd, bool relu, const Tensor& residual) {
  if (x.numel() == 0) return;
  DeviceGuard guard(x.device());
  cudaStream_t stream = current_cuda_stream(x.device());
  Tensor coef = empty({x.size(1) * 3}, gamma.dtype(), x.device());
  dispatch_floating_bf16(x.dtype(), "batch_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using P = opmath_t<T>;  // the per-channel tensors' type (float32 for bfloat16 activations)
    const T* b = bias.defined() ? gpu::cptr<T>(bias) : nullptr;
    gpu::ChannelSplit g;
    Tensor partial;
    if (gpu::channels_last_of(x)) {
      g = gpu::launch_partials_last<2, T>(x, gpu::BnStatsLast<T>{gpu::cptr<T>(x), b}, partial, stream,
                                          gpu::cptr<T>(x));
    } else {
      g = gpu::channel_split_of(x);
      partial = empty({g.c * g.splits * 2}, kFloat64, x.device());
      gpu::with_channel_vec<T>(g.hw, [&](auto vec) {
        gpu::bn_stats_partials<vec.value, T><<<gpu::split_grid(g), gpu::kSplitBlock, 0, stream>>>(
            gpu::cptr<T>(x), b, gpu::ptr<double>(partial), g);
      }, gpu::cptr<T>(x));
      TANDEM_CUDA_CHECK_LAUNCH();
    }
    gpu::bn_stats_finish<T, P><<<gpu::finish_grid(g), gpu::kBlock, 0, stream>>>(
        gpu::cptr<T>(x), b, gpu::cptr<double>(partial), gpu::cptr<P>(gamma), gpu::cptr<P>(beta),
        gpu::ptr<P>(running_mean), gpu::ptr<P>(running_var), momentum, eps, gpu::ptr<P>(save_mean),
        gpu::ptr<P>(save_invstd), gpu::ptr<P>(coef), g);
    TANDEM_CUDA_CHECK_LAUNCH();
    gpu::bn_apply<T, P>(x, bias, coef, y, relu, stream, residual);
  });
}

void CudaBackend::batch_norm_forward_eval(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                                          const Tensor& beta, const Tensor& running_mean,
                                          const Tensor& running_var, double eps, const Tensor& y, bool relu) {
  const gpu::ChannelSplit g = gpu::channel_split_of(x);
  if (x.numel() == 0) return;
  DeviceGuard guard(x.device());
  cudaStream_t stream = current_cuda_stream(x.device());
  Tensor coef = empty({g.c * 3}, gamma.dtype(), x.device());
  dispatch_floating_bf16(x.dtype(), "batch_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using P = opmath_t<T>;  // the per-channel tensors' type (float32 for bfloat16 activations)
    gpu::bn_eval_coef<P><<<gpu::channel_threads_grid(g.c), gpu::kBlock, 0, stream>>>(
        gpu::cptr<P>(gamma), gpu::cptr<P>(beta), gpu::cptr<P>(running_mean), gpu::cptr<P>(running_var), eps,
        gpu::ptr<P>(coef), g.c);
    TANDEM_CUDA_CHECK_LAUNCH();
    gpu::bn_apply<T, P>(x, bias, coef, y, relu, stream);
  });
}

void CudaBackend::batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& bias,
                                      const Tensor& gamma, const Tensor& save_mean,
                                      const Tensor& save_invstd, const Tensor& relu_out,
                                      const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                                      const Tensor& dbias, const Tensor& masked_dy, const Tensor& dy_part) {
  if (x.size(1) == 0) return;
  if (x.numel() == 0) {
    fill(dgamma, 0.0);
    fill(dbeta, 0.0);
    if (dbias.defined()) fill(dbias, 0.0);
    return;
  }
  DeviceGuard guard(x.device());
  cudaStream_t stream = current_cuda_stream(x.device());
  Tensor coef = empty({x.size(1) * 4}, gamma.dtype(), x.device());
  dispatch_floating_bf16(x.dtype(), "batch_norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using P = opmath_t<T>;
    const T* mask = relu_out.defined() ? gpu::cptr<T>(relu_out) : nullptr;
    const T* b = bias.defined() ? gpu::cptr<T>(bias) : nullptr;
    const T* grad = gpu::cptr<T>(dy);  // what the dx pass reads: dy, or the masked dy written out
    gpu::ChannelSplit g;
    Tensor partial;
    Tensor read_dy;  // alive until the dx pass that reads it is enqueued
    if (gpu::channels_last_of(x)) {
      // The gradient as the partials read it -- dy + dy_part, masked -- written out by them when
      // asked for or when there is a part; the dx pass then reads it instead of what it is made of.
      read_dy = masked_dy.defined() || !dy_part.defined()
                    ? masked_dy
                    : Tensor(dy.shape(), dy.dtype(), dy.device(), MemoryFormat::ChannelsLast);
      T* masked = read_dy.defined() ? gpu::ptr<T>(read_dy) : nullptr;
      const T* part = dy_part.defined() ? gpu::cptr<T>(dy_part) : nullptr;
      g = gpu::launch_partials_last<2, T>(
          x, gpu::BnGradLast<T, P>{gpu::cptr<T>(dy), gpu::cptr<T>(x), b, gpu::cptr<P>(save_mean), mask, masked, part},
          partial, stream, gpu::cptr<T>(dy), gpu::cptr<T>(x), mask, static_cast<const T*>(masked), part);
      if (masked != nullptr) grad = masked, mask = nullptr;
    } else {
      if (dy_part.defined()) {  // the engine's add, in a pass of its own
        Tensor sum(dy.shape(), dy.dtype(), dy.device());
        binary(BinaryOp::Add, dy, dy_part, sum);
        batch_norm_backward(sum, x, bias, gamma, save_mean, save_invstd, relu_out, dx, dgamma, dbeta, dbias,
                            masked_dy, Tensor());
        return;
      }
      if (masked_dy.defined()) {  // a pass of its own, as the ReluBackward op
        binary(BinaryOp::ReluBackward, dy, relu_out, masked_dy);
        grad = gpu::cptr<T>(masked_dy), mask = nullptr;
      }
      g = gpu::channel_split_of(x);
      partial = empty({g.c * g.splits * 2}, kFloat64, x.device());
      gpu::with_channel_vec<T>(g.hw, [&](auto vec) {
        gpu::bn_grad_partials<vec.value, T, P><<<gpu::split_grid(g), gpu::kSplitBlock, 0, stream>>>(
            grad, gpu::cptr<T>(x), b, gpu::cptr<P>(save_mean), mask, gpu::ptr<double>(partial), g);
      }, grad, gpu::cptr<T>(x), mask);
      TANDEM_CUDA_CHECK_LAUNCH();
    }
    gpu::bn_grad_finish<P><<<gpu::finish_grid(g), gpu::kBlock, 0, stream>>>(
        gpu::cptr<double>(partial), gpu::cptr<P>(gamma), gpu::cptr<P>(save_mean),
        gpu::cptr<P>(save_invstd), gpu::ptr<P>(dgamma), gpu::ptr<P>(dbeta), gpu::ptr<P>(coef), g);
    TANDEM_CUDA_CHECK_LAUNCH();
    gpu::bn_grad_apply<T, P>(x, bias, coef, grad, mask, dx, dbias, stream);
  });
}

}  // namespace tandem
