#include "autograd/anomaly.h"

#include <cmath>
#include <cstddef>

#include "autograd/node.h"

namespace tandem::autograd {

namespace detail {
constinit thread_local bool t_anomaly_enabled = false;
}  // namespace detail

namespace {

// "[3] float64", or "undefined".
std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined";
  return shape_str(t.shape()) + " " + dtype_name(t.dtype());
}

std::string describe(const std::vector<Tensor>& ts) {
  std::string out;
  for (const Tensor& t : ts) out += (out.empty() ? "" : ", ") + describe(t);
  return out.empty() ? "none" : out;
}

template <typename T>
int64_t first_nonfinite(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(p[i])) return i;
  return -1;
}

// The flat index of t's first NaN or Inf and which it is, or -1. A tensor that is not on the
// CPU is copied there first (a host synchronization; see the header).
int64_t find_nonfinite(const Tensor& t, const char*& what) {
  if (!t.defined() || !is_floating(t.dtype()) || t.numel() == 0) return -1;
  // bfloat16 widens to float32 exactly (NaN and infinities included).
  const Tensor h = t.to(kCPU, t.dtype() == kFloat64 ? kFloat64 : kFloat32).contiguous();
  int64_t i = -1;
  double v = 0;
  if (h.dtype() == kFloat32) {
    i = first_nonfinite(h.data<float>(), h.numel());
    if (i >= 0) v = h.data<float>()[i];
  } else {
    i = first_nonfinite(h.data<double>(), h.numel());
    if (i >= 0) v = h.data<double>()[i];
  }
  what = std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf";
  return i;
}

}  // namespace

namespace detail {

void anomaly_check_forward(Node& node, const std::vector<Tensor>& inputs,
                           const std::vector<Tensor>& outputs) {
  node.anomaly_forward = "forward op " + node.name() + " with inputs: " + describe(inputs);
  for (size_t k = 0; k < outputs.size(); ++k) {
    const char* what = "";
    const int64_t i = find_nonfinite(outputs[k], what);
    if (i < 0) continue;
    throw AnomalyError(tandem::detail::str("anomaly: forward op ", node.name(), " returned ", what,
                                           " in output ", k, " ", describe(outputs[k]),
                                           " (element ", i, "); inputs: ", describe(inputs)));
  }
}

void anomaly_check_backward(const Node& node, const std::vector<Tensor>& input_grads) {
  for (size_t k = 0; k < input_grads.size(); ++k) {
    const char* what = "";
    const int64_t i = find_nonfinite(input_grads[k], what);
    if (i < 0) continue;
    const std::string origin = node.anomaly_forward.empty()
                                   ? std::string("recorded while anomaly mode was off")
                                   : "created by " + node.anomaly_forward;
    throw AnomalyError(tandem::detail::str("anomaly: backward node ", node.name(), "Backward returned ",
                                           what, " in its gradient for input ", k, " ",
                                           describe(input_grads[k]), " (element ", i, "); ", origin));
  }
}

}  // namespace detail

}  // namespace tandem::autograd
