// Batch normalization's forward passes, training and eval (the overview and Note [conv bias in
// batch norm] are in batchnorm.cuh; the backward is batchnorm_backward.cu).
#include "core/device.h"
#include "kernels/cuda/batchnorm.cuh"
#include "kernels/cuda/channel_any.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tandem {

namespace gpu {
namespace {

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
// (mean, gamma * invstd, beta) for the elementwise pass; count (null: none) += 1.
//
// Note [the batch count in the statistics' finish]: BatchNorm2d adds 1 to its num_batches_tracked
// at every training forward. As an op of its own that was a kernel launch per batch norm, on
// the main stream between the convolution and the statistics -- 17 nodes of ~1.4 us and their
// gaps in ResNet-18's replayed step, ~30 us of its ~3.2 ms on an H100 -- to add 1 to one
// integer. The kernel that updates the running statistics adds it now (one thread of its first
// block), in the same stream order as those statistics.
template <typename T, typename P>
__global__ void bn_stats_finish(const T* x, const T* bias, const double* partial, const P* gamma, const P* beta,
                                P* running_mean, P* running_var, double momentum, double eps,
                                P* save_mean, P* save_invstd, P* coef, int64_t* count, ChannelSplit g) {
  wait_for_previous_grid();  // Note [programmatic dependent launch]
  let_next_grid_launch();
  if (count != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *count += 1;
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

unsigned channel_threads_grid(int64_t c) { return static_cast<unsigned>((c + kBlock - 1) / kBlock); }

}  // namespace
}  // namespace gpu

void CudaBackend::batch_norm_forward_train(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                                           const Tensor& beta, const Tensor& running_mean,
                                           const Tensor& running_var, double momentum, double eps,
                                           const Tensor& y, const Tensor& save_mean,
                                           const Tensor& save_invstd, bool relu, const Tensor& residual,
                                           const Tensor& num_batches_tracked) {
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
    gpu::launch_after_previous(
        gpu::bn_stats_finish<T, P>, gpu::finish_grid(g), gpu::kBlock, stream, gpu::cptr<T>(x), b,
        gpu::cptr<double>(partial), gpu::cptr<P>(gamma), gpu::cptr<P>(beta), gpu::ptr<P>(running_mean),
        gpu::ptr<P>(running_var), momentum, eps, gpu::ptr<P>(save_mean), gpu::ptr<P>(save_invstd),
        gpu::ptr<P>(coef), num_batches_tracked.defined() ? gpu::ptr<int64_t>(num_batches_tracked) : nullptr, g);
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

}  // namespace tandem
