// Elementwise kernels: fill, copy (with dtype conversion), unary, binary, scalar, axpby.
// Every op is a functor handed to map_elements (map.cuh), which picks the vectorized
// contiguous kernel or the strided one. The arithmetic mirrors kernels/cpu/elementwise.cpp
// op for op (including which ops exist for integer dtypes) so both backends agree; bfloat16
// computes in float and rounds once per element (Note [bfloat16 arithmetic]).
#include <type_traits>

#include "core/device.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/map.cuh"

namespace tandem {

namespace gpu {
namespace {

// Float-only ops exist for float32, float64 and bfloat16.
template <typename T>
constexpr bool kFloat = is_floating_type_v<T>;

template <typename T>
struct FillFn {
  T value;
  __device__ T operator()() const { return value; }
};

template <typename S, typename D>
struct CastFn {
  __device__ D operator()(S x) const { return static_cast<D>(x); }
};

// Each functor computes in C = opmath_t<T> (float for bfloat16, T itself otherwise) and
// rounds once at the end, as the CPU kernels do.
template <typename T, UnaryOp OP>
struct UnaryFn {
  __device__ T operator()(T x) const {
    using C = opmath_t<T>;
    const C v = static_cast<C>(x);
    if constexpr (OP == UnaryOp::Neg) return static_cast<T>(-v);
    if constexpr (OP == UnaryOp::Relu) return static_cast<T>(v > C(0) ? v : C(0));
    if constexpr (OP == UnaryOp::Abs) {
      if constexpr (std::is_unsigned_v<T>) return x;
      else return static_cast<T>(v < C(0) ? -v : v);
    }
    if constexpr (OP == UnaryOp::Square) return static_cast<T>(v * v);
    if constexpr (kFloat<T>) {
      if constexpr (OP == UnaryOp::Exp) return static_cast<T>(d_exp(v));
      if constexpr (OP == UnaryOp::Log) return static_cast<T>(d_log(v));
      if constexpr (OP == UnaryOp::Sigmoid) return static_cast<T>(C(1) / (C(1) + d_exp(-v)));
      if constexpr (OP == UnaryOp::Tanh) return static_cast<T>(d_tanh(v));
      if constexpr (OP == UnaryOp::Sqrt) return static_cast<T>(d_sqrt(v));
      if constexpr (OP == UnaryOp::Reciprocal) return static_cast<T>(C(1) / v);
    }
    return x;  // not reached: the host never instantiates a float-only op for integers
  }
};

template <typename T, BinaryOp OP>
struct BinaryFn {
  __device__ T operator()(T x, T y) const {
    using C = opmath_t<T>;
    const C a = static_cast<C>(x), b = static_cast<C>(y);
    if constexpr (OP == BinaryOp::Add) return static_cast<T>(a + b);
    if constexpr (OP == BinaryOp::Sub) return static_cast<T>(a - b);
    if constexpr (OP == BinaryOp::Mul) return static_cast<T>(a * b);
    // NaN from either side propagates, as torch.maximum/minimum do.
    if constexpr (OP == BinaryOp::Max) return (a > b || a != a) ? x : y;
    if constexpr (OP == BinaryOp::Min) return (a < b || a != a) ? x : y;
    if constexpr (OP == BinaryOp::Eq) return a == b ? T(1) : T(0);
    if constexpr (OP == BinaryOp::AddRelu) {  // relu(add(x, y)) bit for bit: the sum rounded to T first
      const C s = static_cast<C>(static_cast<T>(a + b));
      return static_cast<T>(s > C(0) ? s : C(0));
    }
    if constexpr (kFloat<T>) {
      if constexpr (OP == BinaryOp::Div) return static_cast<T>(a / b);
      if constexpr (OP == BinaryOp::ReluBackward) return b > C(0) ? x : T(0);
      if constexpr (OP == BinaryOp::SigmoidBackward) return static_cast<T>(a * b * (C(1) - b));
      if constexpr (OP == BinaryOp::TanhBackward) return static_cast<T>(a * (C(1) - b * b));
    }
    return x;  // not reached
  }
};

// The scalar stays in C: a bfloat16 tensor times 0.1 multiplies by float 0.1, not by 0.1
// rounded to bfloat16 (PyTorch keeps scalars in opmath precision too).
template <typename T, ScalarOp OP>
struct ScalarFn {
  opmath_t<T> s;
  __device__ T operator()(T x) const {
    using C = opmath_t<T>;
    const C v = static_cast<C>(x);
    if constexpr (OP == ScalarOp::Add) return static_cast<T>(v + s);
    if constexpr (OP == ScalarOp::Mul) return static_cast<T>(v * s);
    if constexpr (OP == ScalarOp::RSub) return static_cast<T>(s - v);
    if constexpr (kFloat<T>) {
      if constexpr (OP == ScalarOp::RDiv) return static_cast<T>(s / v);
      if constexpr (OP == ScalarOp::Pow) return static_cast<T>(d_pow(v, s));
    }
    return x;  // not reached
  }
};

// out = alpha * x + beta * out, with the two special cases the CPU backend also has.
template <typename T>
struct ScaleFn {
  opmath_t<T> alpha;
  __device__ T operator()(T x) const {
    return static_cast<T>(alpha * static_cast<opmath_t<T>>(x));
  }
};
template <typename T>
struct AddFn {
  __device__ T operator()(T x, T o) const {
    return static_cast<T>(static_cast<opmath_t<T>>(x) + static_cast<opmath_t<T>>(o));
  }
};
// Note [bfloat16 axpby without contraction]: nvcc contracts alpha * x + beta * o into
// fma(alpha, x, beta * o), which skips the rounding of alpha * x; the CPU (baseline x86-64, no
// FMA) rounds both products and the sum separately. Where the sum cancels that is the whole
// result: axpby(0.3, x = 1.6796875, -2, o = 0.251953125) is 0.50390625 - 0.50390625 = +0 on the
// CPU but the rounding error of 0.3f * x, 2.0e-8 (bfloat16 0x32ac), on the GPU, an unbounded
// number of bfloat16 ulps apart. __fmul_rn / __fadd_rn are never contracted, so the bfloat16
// kernel computes exactly the CPU's float expression and the two agree bit for bit (the
// rounding to 8 bits hides the FMA's extra precision anyway). float32 and float64 keep the
// FMA: there the difference is one rounding error, far below their tolerances.
template <typename T>
struct AxpbyFn {
  opmath_t<T> alpha, beta;
  __device__ T operator()(T x, T o) const {
    using C = opmath_t<T>;
    const C xv = static_cast<C>(x), ov = static_cast<C>(o);
    if constexpr (std::is_same_v<T, BFloat16>) {
      return static_cast<T>(__fadd_rn(__fmul_rn(alpha, xv), __fmul_rn(beta, ov)));
    } else {
      return static_cast<T>(alpha * xv + beta * ov);
    }
  }
};

template <auto V>
using Const = std::integral_constant<decltype(V), V>;

template <typename T>
void unary_typed(UnaryOp op, const Tensor& x, const Tensor& out) {
  auto run = [&](auto c) { map_elements<T, T>("unary", UnaryFn<T, decltype(c)::value>{}, out, x); };
  switch (op) {
    case UnaryOp::Neg: return run(Const<UnaryOp::Neg>{});
    case UnaryOp::Relu: return run(Const<UnaryOp::Relu>{});
    case UnaryOp::Abs: return run(Const<UnaryOp::Abs>{});
    case UnaryOp::Square: return run(Const<UnaryOp::Square>{});
    default: break;
  }
  if constexpr (kFloat<T>) {
    switch (op) {
      case UnaryOp::Exp: return run(Const<UnaryOp::Exp>{});
      case UnaryOp::Log: return run(Const<UnaryOp::Log>{});
      case UnaryOp::Sigmoid: return run(Const<UnaryOp::Sigmoid>{});
      case UnaryOp::Tanh: return run(Const<UnaryOp::Tanh>{});
      case UnaryOp::Sqrt: return run(Const<UnaryOp::Sqrt>{});
      case UnaryOp::Reciprocal: return run(Const<UnaryOp::Reciprocal>{});
      default: break;
    }
  }
  TANDEM_THROW(DType, "unary op ", static_cast<int>(op), " is not defined for ",
               dtype_name(x.dtype()));
}

template <typename T>
void binary_typed(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  auto run = [&](auto c) {
    map_elements<T, T, T>("binary", BinaryFn<T, decltype(c)::value>{}, out, a, b);
  };
  switch (op) {
    case BinaryOp::Add: return run(Const<BinaryOp::Add>{});
    case BinaryOp::Sub: return run(Const<BinaryOp::Sub>{});
    case BinaryOp::Mul: return run(Const<BinaryOp::Mul>{});
    case BinaryOp::Max: return run(Const<BinaryOp::Max>{});
    case BinaryOp::Min: return run(Const<BinaryOp::Min>{});
    case BinaryOp::Eq: return run(Const<BinaryOp::Eq>{});
    case BinaryOp::AddRelu: return run(Const<BinaryOp::AddRelu>{});
    default: break;
  }
  if constexpr (kFloat<T>) {
    switch (op) {
      case BinaryOp::Div: return run(Const<BinaryOp::Div>{});
      case BinaryOp::ReluBackward: return run(Const<BinaryOp::ReluBackward>{});
      case BinaryOp::SigmoidBackward: return run(Const<BinaryOp::SigmoidBackward>{});
      case BinaryOp::TanhBackward: return run(Const<BinaryOp::TanhBackward>{});
      default: break;
    }
  }
  TANDEM_THROW(DType, "binary op ", static_cast<int>(op), " is not defined for ",
               dtype_name(a.dtype()));
}

template <typename T>
void scalar_typed(ScalarOp op, const Tensor& x, double s, const Tensor& out) {
  const opmath_t<T> sv = static_cast<opmath_t<T>>(s);
  auto run = [&](auto c) {
    map_elements<T, T>("scalar", ScalarFn<T, decltype(c)::value>{sv}, out, x);
  };
  switch (op) {
    case ScalarOp::Add: return run(Const<ScalarOp::Add>{});
    case ScalarOp::Mul: return run(Const<ScalarOp::Mul>{});
    case ScalarOp::RSub: return run(Const<ScalarOp::RSub>{});
    default: break;
  }
  if constexpr (kFloat<T>) {
    switch (op) {
      case ScalarOp::RDiv: return run(Const<ScalarOp::RDiv>{});
      case ScalarOp::Pow:
        // The common exponents avoid pow, exactly as the CPU backend does.
        if (s == 2.0) return map_elements<T, T>("pow", UnaryFn<T, UnaryOp::Square>{}, out, x);
        if (s == 1.0) return map_elements<T, T>("pow", CastFn<T, T>{}, out, x);
        if (s == 0.5) return map_elements<T, T>("pow", UnaryFn<T, UnaryOp::Sqrt>{}, out, x);
        if (s == -1.0) return map_elements<T, T>("pow", UnaryFn<T, UnaryOp::Reciprocal>{}, out, x);
        return run(Const<ScalarOp::Pow>{});
      default: break;
    }
  }
  TANDEM_THROW(DType, "scalar op ", static_cast<int>(op), " is not defined for ",
               dtype_name(x.dtype()));
}

}  // namespace
}  // namespace gpu

void CudaBackend::fill(const Tensor& out, double value) {
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device());
  if (value == 0.0 && out.is_contiguous()) {
    // All-zero bytes are 0 in every dtype (+0.0 for floats).
    TANDEM_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(),
                                      current_cuda_stream(out.device())));
    return;
  }
  dispatch_all(out.dtype(), "fill", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::map_elements<T>("fill", gpu::FillFn<T>{static_cast<T>(value)}, out);
  });
}

void CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  if (dst.numel() == 0) return;
  DeviceGuard guard(dst.device());
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    if (src.raw_data() != dst.raw_data()) {
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), dst.nbytes(),
                                        cudaMemcpyDeviceToDevice,
                                        current_cuda_stream(dst.device())));
    }
    return;
  }
  dispatch_all(src.dtype(), "copy", [&](auto stag) {
    using S = typename decltype(stag)::type;
    dispatch_all(dst.dtype(), "copy", [&](auto dtag) {
      using D = typename decltype(dtag)::type;
      gpu::map_elements<D, S>("copy", gpu::CastFn<S, D>{}, dst, src);
    });
  });
}

void CudaBackend::unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  DeviceGuard guard(out.device());
  dispatch_all(x.dtype(), "unary", [&](auto tag) {
    gpu::unary_typed<typename decltype(tag)::type>(op, x, out);
  });
}

void CudaBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  DeviceGuard guard(out.device());
  dispatch_all(a.dtype(), "binary", [&](auto tag) {
    gpu::binary_typed<typename decltype(tag)::type>(op, a, b, out);
  });
}

void CudaBackend::scalar(ScalarOp op, const Tensor& x, double s, const Tensor& out) {
  DeviceGuard guard(out.device());
  dispatch_all(x.dtype(), "scalar", [&](auto tag) {
    gpu::scalar_typed<typename decltype(tag)::type>(op, x, s, out);
  });
}

void CudaBackend::axpby(double alpha, const Tensor& x, double beta, const Tensor& out) {
  DeviceGuard guard(out.device());
  dispatch_all(x.dtype(), "axpby", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = opmath_t<T>;
    const C al = static_cast<C>(alpha), be = static_cast<C>(beta);
    // beta == 0 ignores out's old contents (as BLAS does): NaNs or uninitialized memory in it
    // never reach the result.
    if (beta == 0.0) {
      gpu::map_elements<T, T>("axpby", gpu::ScaleFn<T>{al}, out, x);
    } else if (alpha == 1.0 && beta == 1.0) {
      gpu::map_elements<T, T, T>("axpby", gpu::AddFn<T>{}, out, x, out);
    } else {
      gpu::map_elements<T, T, T>("axpby", gpu::AxpbyFn<T>{al, be}, out, x, out);
    }
  });
}

}  // namespace tandem
