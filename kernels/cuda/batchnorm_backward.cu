// Batch normalization's backward: the gradient partial sums, their finish into dgamma, dbeta
// and the dx coefficients, and the dx pass (the overview and Note [conv bias in batch norm] are
// in batchnorm.cuh; the forward is batchnorm.cu).
#include "core/device.h"
#include "kernels/cuda/batchnorm.cuh"
#include "kernels/cuda/channel_any.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tandem {

namespace gpu {
namespace {

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
  wait_for_previous_grid();  // Note [programmatic dependent launch]
  let_next_grid_launch();
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
// [conv bias in batch norm]), in T or, rounded to T, in P.
//
// Note [the conv bias's gradient in float32]: under autocast a convolution's float32 bias reaches
// the batch norm as its bfloat16 copy, so its gradient was a bfloat16 [C] that the conversion's
// backward then cast into the float32 .grad: a kernel of ~1.2 us on the main stream after every
// such batch norm's backward (17 in ResNet-18's step, ~1.7 us each with the gap). When the
// autograd function is lent that .grad (weight_grad_destination, through the conversion), the
// finish kernel of the dx pass's sums writes it: each sum rounded to bfloat16 as before, stored
// as float32 -- the bits the cast wrote.
template <typename T, typename P>
void bn_grad_apply(const Tensor& x, const Tensor& bias, const Tensor& coef, const T* dy, const T* mask,
                   const Tensor& dx, const Tensor& dbias, cudaStream_t stream) {
  const T* b = bias.defined() ? cptr<T>(bias) : nullptr;
  const auto run = [&](const auto& f, const auto*... in) {
    if (dbias.defined() && dbias.dtype() != x.dtype()) {  // P: kernels::batch_norm_backward checked it
      channel_map_sum_any(x, f, ptr<T>(dx), ptr<P>(dbias), stream, in...);
    } else if (dbias.defined()) {
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

}  // namespace
}  // namespace gpu

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
    gpu::launch_after_previous(gpu::bn_grad_finish<P>, gpu::finish_grid(g), gpu::kBlock, stream,
                               gpu::cptr<double>(partial), gpu::cptr<P>(gamma), gpu::cptr<P>(save_mean),
                               gpu::cptr<P>(save_invstd), gpu::ptr<P>(dgamma), gpu::ptr<P>(dbeta),
                               gpu::ptr<P>(coef), g);
    gpu::bn_grad_apply<T, P>(x, bias, coef, grad, mask, dx, dbias, stream);
  });
}

}  // namespace tandem
