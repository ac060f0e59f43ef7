// log_softmax over rows, fused cross-entropy and the accuracy counter.
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_kernels.h"

namespace tandem::cpu {

namespace {

// y = x - (max + log(sum(exp(x - max)))) for one row; subtracting the max keeps exp in range.
template <typename T>
void log_softmax_row(const T* x, T* y, int64_t c) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < c; ++j) m = x[j] > m || x[j] != x[j] ? x[j] : m;
  double s = 0;
  for (int64_t j = 0; j < c; ++j) s += std::exp(static_cast<double>(x[j] - m));
  // An all -inf row has no finite max; its log-probabilities are NaN, as in PyTorch.
  const T lse = static_cast<T>(static_cast<double>(m) + std::log(s));
  for (int64_t j = 0; j < c; ++j) y[j] = x[j] - lse;
}

// Targets are read on the host here, so a bad one is a clean exception rather than a wrong loss.
void check_targets(const char* op, const int64_t* t, int64_t n, int64_t c) {
  for (int64_t i = 0; i < n; ++i) {
    TANDEM_CHECK(t[i] >= 0 && t[i] < c, Value, op, ": target[", i, "] = ", t[i],
                 " is out of range for ", c, " classes");
  }
}

template <typename T>
int64_t first_argmax(const T* x, int64_t c) {
  int64_t best = 0;
  for (int64_t j = 1; j < c; ++j) {
    if (x[j] > x[best]) best = j;
  }
  return best;
}

}  // namespace

void CpuBackend::log_softmax(const Tensor& x, const Tensor& y) {
  const int64_t n = x.size(0), c = x.size(1);
  dispatch_floating(x.dtype(), "log_softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = static_cast<const T*>(x.raw_data());
    T* py = static_cast<T*>(y.raw_data());
    for (int64_t i = 0; i < n; ++i) log_softmax_row(px + i * c, py + i * c, c);
  });
}

void CpuBackend::log_softmax_backward(const Tensor& dy, const Tensor& y, const Tensor& dx) {
  const int64_t n = y.size(0), c = y.size(1);
  dispatch_floating(y.dtype(), "log_softmax_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* pdy = static_cast<const T*>(dy.raw_data());
    const T* py = static_cast<const T*>(y.raw_data());
    T* pdx = static_cast<T*>(dx.raw_data());
    for (int64_t i = 0; i < n; ++i) {
      const T* g = pdy + i * c;
      const T* yr = py + i * c;
      T* d = pdx + i * c;
      double s = 0;
      for (int64_t j = 0; j < c; ++j) s += g[j];
      const T st = static_cast<T>(s);
      for (int64_t j = 0; j < c; ++j) d[j] = g[j] - std::exp(yr[j]) * st;
    }
  });
}

void CpuBackend::cross_entropy_forward(const Tensor& logits, const Tensor& target,
                                       const Tensor& log_probs, const Tensor& loss) {
  const int64_t n = logits.size(0), c = logits.size(1);
  const int64_t* t = target.data<int64_t>();
  check_targets("cross_entropy", t, n, c);
  dispatch_floating(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = static_cast<const T*>(logits.raw_data());
    T* lp = static_cast<T*>(log_probs.raw_data());
    double s = 0;
    for (int64_t i = 0; i < n; ++i) {
      log_softmax_row(px + i * c, lp + i * c, c);
      s += lp[i * c + t[i]];
    }
    *static_cast<T*>(loss.raw_data()) = static_cast<T>(-s / static_cast<double>(n));
  });
}

void CpuBackend::cross_entropy_backward(const Tensor& log_probs, const Tensor& target,
                                        const Tensor& dloss, const Tensor& dlogits) {
  const int64_t n = log_probs.size(0), c = log_probs.size(1);
  const int64_t* t = target.data<int64_t>();
  check_targets("cross_entropy_backward", t, n, c);
  dispatch_floating(log_probs.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* lp = static_cast<const T*>(log_probs.raw_data());
    T* d = static_cast<T*>(dlogits.raw_data());
    const T scale = static_cast<T>(static_cast<double>(*static_cast<const T*>(dloss.raw_data())) /
                                   static_cast<double>(n));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < c; ++j) d[i * c + j] = std::exp(lp[i * c + j]) * scale;
      d[i * c + t[i]] -= scale;
    }
  });
}

void CpuBackend::count_correct(const Tensor& logits, const Tensor& target, const Tensor& correct) {
  const int64_t n = logits.size(0), c = logits.size(1);
  const int64_t* t = target.data<int64_t>();
  int64_t hits = 0;
  dispatch_floating(logits.dtype(), "count_correct", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = static_cast<const T*>(logits.raw_data());
    for (int64_t i = 0; i < n; ++i) hits += first_argmax(px + i * c, c) == t[i] ? 1 : 0;
  });
  *correct.data<int64_t>() += hits;
}

}  // namespace tandem::cpu
