// tandem's own kernels for small linear layers with their bias and activation fused (Note
// [linear + activation] in kernels/backend.h).
//
// Note [small fused linear layers]: LeNet's classifier (400 -> 120 -> 84 -> 10 at batch 256) is
// 15 M multiply-adds forward, yet cuBLAS runs each product as a split-K pair of kernels tiled for
// large matrices, and the bias, the activation, its gradient and the bias gradient are passes
// of their own. Here each pass is one kernel of 256-thread blocks over tiles of the output, the
// reduction dimension staged through shared memory 64 at a time (the next stage loaded into
// registers while the current one is summed):
//
// - forward, y = act(x @ w^T + bias): x [M, K] and w [N, K] are both read along K, the bias
//   added to the sum and the activation applied before the only store;
// - input gradient, dx = dz @ w with dz = dy * act'(y) formed as the tile of dy is loaded (so
//   dz is never written);
// - weight gradient, dw = dz^T @ x, and the bias gradient as one more column of the same
//   product whose input is 1 (the column sums of dz).
//
// The tile is 16 x 16 outputs, one thread each, except in the weight gradient of a small
// layer: its outputs are few and each is a long sum (LeNet's last layer: 10 x 85 outputs, each
// a sum of 256 products), so where 16 x 16 tiles would give fewer than four blocks per
// multiprocessor the tile shrinks to 8 x 8 or 4 x 4 and the block's 256 threads split each
// output's reduction 4 or 16 ways: slice s of the block sums the terms s*64/S .. (s+1)*64/S - 1
// of every stage, and the S partial sums are added in slice order at the end. Measured on an
// H200 in LeNet's replayed step, the three weight-gradient passes took 20.2 us with 16 x 16
// tiles and 15.8 us with the split (ncu, before: 12% achieved occupancy, 8-17 cycles between a
// warp's instructions). The forward and input-gradient passes were slower split (forward
// 400 -> 120: 5.8 us whole, 9.9 us split 16 ways): their time is the chain of dependent stage
// loads, which a split does not shorten, so they keep whole tiles. Nor did staging 128
// elements per iteration instead of 64 shorten it: the nine passes took 49.3 us (the 400 ->
// 120 input gradient 13.9 us against 7.5), so every pass stages 64.
//
// Each output is a sum in a fixed order (the terms of a slice in order of the reduced index,
// each an FMA, then the slices in order): the same bits on every run and on a CUDA graph replay
// (Note [deterministic reductions]). The tile depends on the layer's shape and the GPU's
// multiprocessor count, not on which gradients are asked for (the weight gradient's tile is
// chosen for all k + 1 columns, so dw alone, db alone and both agree bit for bit). The
// activation's arithmetic is the elementwise kernels' (UnaryOp::Relu and Sigmoid,
// BinaryOp::ReluBackward and SigmoidBackward), so fused and unfused layers differ only in the
// summation order of their products. Used for float32 and float64 when M is at most kMaxRows
// and M * N * K at most kMaxWork multiply-adds -- where these tiles still fill the GPU in one
// short wave; larger layers go to cuBLAS (the dispatcher composes).
#include "core/device.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tandem {

namespace gpu {
namespace {

constexpr int kStep = 64;                       // reduction elements staged per iteration
constexpr int kThreads = 256;                   // per block, whatever the tile
constexpr int64_t kMaxRows = 4096;              // M: the weight gradient's reduction length
constexpr int64_t kMaxWork = int64_t{1} << 24;  // M * N * K multiply-adds

// The three passes are one pattern, out[r, c] = sum over t of a(r, t) * b(c, t):
//   Forward     r < m, c < n, t < k: a = x[r, t], b = w[c, t]; out = y = act(sum + bias[c])
//   InputGrad   r < m, c < k, t < n: a = dz[r, t], b = w[t, c]; out = dx
//   WeightGrad  r < n, c in [first, last), t < m: a = dz[t, r], b = x[t, c] (1 for c = k);
//               out = dw for c < k, db for c = k
enum class Pass { Forward, InputGrad, WeightGrad };

template <typename T>
struct LinearArgs {
  using type = T;  // the element type, for the entry points' generic lambdas
  const T* dy;    // [m, n] (backward)
  const T* y;     // [m, n] (backward, activations)
  const T* x;     // [m, k]
  const T* w;     // [n, k]
  const T* bias;  // [n] (forward) or null
  T* out;         // y, dx or dw
  T* db;          // [n] (WeightGrad) or null
  int m, n, k;
  int first, last;  // WeightGrad: the columns computed
};

template <Pass P>
constexpr bool kAAlongT = P != Pass::WeightGrad;  // a(r, t) contiguous in t (else in r)
template <Pass P>
constexpr bool kBAlongT = P == Pass::Forward;

template <typename T, Activation A, Pass P>
__device__ T operand_a(const LinearArgs<T>& p, int r, int t) {
  if constexpr (P == Pass::Forward) {
    return r < p.m && t < p.k ? p.x[static_cast<int64_t>(r) * p.k + t] : T(0);
  } else {
    const int i = P == Pass::InputGrad ? r : t, j = P == Pass::InputGrad ? t : r;  // dz[i, j]
    if (i >= p.m || j >= p.n) return T(0);
    const int64_t e = static_cast<int64_t>(i) * p.n + j;
    return activation_grad<T, A>(p.dy[e], A == Activation::None ? T(0) : p.y[e]);
  }
}

template <typename T, Pass P>
__device__ T operand_b(const LinearArgs<T>& p, int c, int t) {
  if constexpr (P == Pass::Forward) {
    return c < p.n && t < p.k ? p.w[static_cast<int64_t>(c) * p.k + t] : T(0);
  } else if constexpr (P == Pass::InputGrad) {
    return c < p.k && t < p.n ? p.w[static_cast<int64_t>(t) * p.k + c] : T(0);
  } else {
    if (t >= p.m || c >= p.last) return T(0);
    return c == p.k ? T(1) : p.x[static_cast<int64_t>(t) * p.k + c];
  }
}

// Element i of a thread's share of a rows x kStep operand tile: (tile row, t) so that
// neighbouring threads read neighbouring addresses.
template <bool AlongT, int Rows>
__device__ void tile_slot(int i, int& r, int& t) {
  const int e = static_cast<int>(threadIdx.x) + i * kThreads;
  if constexpr (AlongT) {
    r = e / kStep, t = e % kStep;
  } else {
    r = e % Rows, t = e / Rows;
  }
}

// One kernel for the three passes over Tile x Tile outputs per block; grid (ceil(columns /
// Tile), ceil(rows / Tile)). The block's threads are kSlices slices of one thread per output;
// slice s sums the terms [s * kStep / kSlices, (s + 1) * kStep / kSlices) of every stage. The
// next stage of both operands is loaded into registers while the current one is summed from
// shared memory; rows are padded to 16 bytes so the sums read 16-byte words.
template <typename T, Activation A, Pass P, int Tile>
__global__ void __launch_bounds__(kThreads) linear_pass_kernel(const LinearArgs<T> p) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  constexpr int kOutputs = Tile * Tile;
  constexpr int kSlices = kThreads / kOutputs;
  constexpr int kSliceLen = kStep / kSlices;
  constexpr int kLoads = Tile * kStep / kThreads;  // elements of each operand a thread stages
  static_assert(kSlices * kOutputs == kThreads && kLoads >= 1 && kSliceLen >= 1, "tile");
  constexpr int kPad = 16 / sizeof(T);
  __shared__ __align__(16) T as[Tile][kStep + kPad];  // as[r][t] = a(row0 + r, t0 + t)
  __shared__ __align__(16) T bs[Tile][kStep + kPad];  // bs[c][t] = b(col0 + c, t0 + t)
  const int o = static_cast<int>(threadIdx.x) % kOutputs, slice = static_cast<int>(threadIdx.x) / kOutputs;
  const int tx = o % Tile, ty = o / Tile;
  const int len = P == Pass::Forward ? p.k : P == Pass::InputGrad ? p.n : p.m;
  const int row0 = blockIdx.y * Tile;
  const int col0 = (P == Pass::WeightGrad ? p.first : 0) + blockIdx.x * Tile;
  T ra[kLoads], rb[kLoads];
  const auto fetch = [&](int t0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      int r, t;
      tile_slot<kAAlongT<P>, Tile>(i, r, t);
      ra[i] = operand_a<T, A, P>(p, row0 + r, t0 + t);
      tile_slot<kBAlongT<P>, Tile>(i, r, t);
      rb[i] = operand_b<T, P>(p, col0 + r, t0 + t);
    }
  };
  fetch(0);
  T acc = 0;
  for (int t0 = 0; t0 < len; t0 += kStep) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      int r, t;
      tile_slot<kAAlongT<P>, Tile>(i, r, t);
      as[r][t] = ra[i];
      tile_slot<kBAlongT<P>, Tile>(i, r, t);
      bs[r][t] = rb[i];
    }
    __syncthreads();
    if (t0 + kStep < len) fetch(t0 + kStep);
    // Past the end both operands are 0: fma(0, 0, acc) is acc.
#pragma unroll
    for (int t = slice * kSliceLen; t < (slice + 1) * kSliceLen; ++t) acc = fma(as[ty][t], bs[tx][t], acc);
    __syncthreads();
  }
  if constexpr (kSlices > 1) {
    // The slices' partial sums, added in slice order by slice 0.
    __shared__ T partial[kSlices][kOutputs];
    partial[slice][o] = acc;
    __syncthreads();
    if (slice != 0) return;
#pragma unroll
    for (int s = 1; s < kSlices; ++s) acc += partial[s][o];
  }
  const int row = row0 + ty, col = col0 + tx;
  if constexpr (P == Pass::Forward) {
    if (row < p.m && col < p.n) {
      const T z = p.bias != nullptr ? acc + p.bias[col] : acc;
      p.out[static_cast<int64_t>(row) * p.n + col] = activate<T, A>(z);
    }
  } else if constexpr (P == Pass::InputGrad) {
    if (row < p.m && col < p.k) p.out[static_cast<int64_t>(row) * p.k + col] = acc;
  } else {
    if (row >= p.n || col >= p.last) return;
    if (col < p.k) {
      p.out[static_cast<int64_t>(row) * p.k + col] = acc;
    } else {
      p.db[row] = acc;
    }
  }
}

bool fused_linear_applies(DType dt, int64_t m, int64_t n, int64_t k) {
  return (dt == kFloat32 || dt == kFloat64) && m >= 1 && n >= 1 && k >= 1 && m <= kMaxRows &&
         m * n * k <= kMaxWork;
}

// The output tile of pass P over rows x cols outputs (Note [small fused linear layers]): 16
// for the forward and the input gradient; for the weight gradient the largest of 16, 8 and 4
// whose grid has at least four blocks per multiprocessor, else 4.
template <Pass P>
int pass_tile(int64_t cols, int64_t rows) {
  if constexpr (P != Pass::WeightGrad) {
    return 16;
  } else {
    const int64_t enough = one_wave_blocks() / 2;  // one_wave_blocks() is eight per multiprocessor
    for (int tile : {16, 8}) {
      if (ceil_div(cols, tile) * ceil_div(rows, tile) >= enough) return tile;
    }
    return 4;
  }
}

// The weight-gradient kernel with a tile of 8 or 4 (the reduction split in the block).
template <typename T, Activation A>
void launch_split(const LinearArgs<T>& a, dim3 grid, int tile, cudaStream_t stream) {
  if (tile == 8) {
    launch_after_previous(linear_pass_kernel<T, A, Pass::WeightGrad, 8>, grid, kThreads, stream, a);
  } else {
    launch_after_previous(linear_pass_kernel<T, A, Pass::WeightGrad, 4>, grid, kThreads, stream, a);
  }
}

// Launches pass P over the columns [first, first + cols) of an output of rows x tile_cols (the
// tile chosen for tile_cols: the weight gradient's whole width, whichever columns are asked for).
template <typename T, Activation A, Pass P>
void launch_pass(const LinearArgs<T>& a, int64_t cols, int64_t rows, int64_t tile_cols, cudaStream_t stream) {
  const int tile = pass_tile<P>(tile_cols, rows);
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, tile)), static_cast<unsigned>(ceil_div(rows, tile)));
  if (P != Pass::WeightGrad || tile == 16) {
    launch_after_previous(linear_pass_kernel<T, A, P, 16>, grid, kThreads, stream, a);
  } else if constexpr (P == Pass::WeightGrad) {
    launch_split<T, A>(a, grid, tile, stream);
  }
}

// The frame of both entry points: false, having done nothing, where the fused kernels do not
// apply to a layer of [m, k] -> [m, n] in t's dtype; otherwise, on t's device,
// fn(args with m, n and k set, the activation as a constant, the stream) for that dtype.
template <typename Fn>
bool with_fused_linear(const char* op, const Tensor& t, Activation act, int64_t m, int64_t n,
                       int64_t k, Fn&& fn) {
  if (!fused_linear_applies(t.dtype(), m, n, k)) return false;
  DeviceGuard guard(t.device());
  cudaStream_t stream = current_cuda_stream(t.device());
  dispatch_floating(t.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    LinearArgs<T> a{};
    a.m = static_cast<int>(m), a.n = static_cast<int>(n), a.k = static_cast<int>(k);
    dispatch_activation(act, [&](auto c) { fn(a, c, stream); });
  });
  return true;
}

}  // namespace
}  // namespace gpu

bool CudaBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Activation act,
                                 const Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const auto launch = [&](auto a, auto c, cudaStream_t stream) {
    using T = typename decltype(a)::type;
    a.x = gpu::cptr<T>(x), a.w = gpu::cptr<T>(w), a.bias = bias.defined() ? gpu::cptr<T>(bias) : nullptr;
    a.out = gpu::ptr<T>(y);
    gpu::launch_pass<T, decltype(c)::value, gpu::Pass::Forward>(a, n, m, n, stream);
  };
  return gpu::with_fused_linear("linear", x, act, m, n, k, launch);
}

bool CudaBackend::linear_backward(const Tensor& dy, const Tensor& y, const Tensor& x, const Tensor& w,
                                  Activation act, int64_t in_features, const Tensor& dx, const Tensor& dw,
                                  const Tensor& db) {
  const int64_t m = dy.size(0), n = dy.size(1), k = in_features;
  const auto launch = [&](auto a, auto c, cudaStream_t stream) {
    using T = typename decltype(a)::type;
    constexpr Activation A = decltype(c)::value;
    a.dy = gpu::cptr<T>(dy), a.y = act == Activation::None ? nullptr : gpu::cptr<T>(y);
    if (dx.defined()) {
      gpu::LinearArgs<T> g = a;
      g.w = gpu::cptr<T>(w), g.out = gpu::ptr<T>(dx);
      gpu::launch_pass<T, A, gpu::Pass::InputGrad>(g, k, m, k, stream);
    }
    if (dw.defined() || db.defined()) {
      gpu::LinearArgs<T> g = a;
      g.x = dw.defined() ? gpu::cptr<T>(x) : nullptr, g.out = dw.defined() ? gpu::ptr<T>(dw) : nullptr;
      g.db = db.defined() ? gpu::ptr<T>(db) : nullptr;
      g.first = dw.defined() ? 0 : a.k;
      g.last = db.defined() ? a.k + 1 : a.k;
      gpu::launch_pass<T, A, gpu::Pass::WeightGrad>(g, g.last - g.first, n, a.k + 1, stream);
    }
  };
  return gpu::with_fused_linear("linear_backward", dy, act, m, n, k, launch);
}

}  // namespace tandem
