// Finite-difference gradient check.
#include "autograd/gradcheck.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "autograd/grad_mode.h"
#include "core/generator.h"

namespace tandem::autograd {

namespace {

// Restores the thread's grad mode when the scope ends (gradcheck needs it on for the analytic part).
class GradModeScope {
 public:
  explicit GradModeScope(bool enabled) : prev_(grad_enabled()) { set_grad_enabled(enabled); }
  ~GradModeScope() { set_grad_enabled(prev_); }
  GradModeScope(const GradModeScope&) = delete;
  GradModeScope& operator=(const GradModeScope&) = delete;

 private:
  bool prev_;
};

std::vector<double> host_values(const Tensor& t) {
  return t.to(kCPU, kFloat64).contiguous().to_vector<double>();
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, double eps, double atol, double rtol) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& in = inputs[i];
    if (!in.defined() || !in.requires_grad()) continue;
    TANDEM_CHECK(in.dtype() == kFloat64, DType, "gradcheck: input ", i, " requires grad but is ",
                 in.str(), "; use float64");
    TANDEM_CHECK(in.is_leaf(), Value, "gradcheck: input ", i, " ", in.str(),
                 " requires grad but is not a leaf (its .grad is never written)");
  }
  GradModeScope grad_on(true);

  // Analytic: backward of sum(out * w) is backward of out with grad_output w.
  Tensor out = fn(inputs);
  TANDEM_CHECK(out.defined(), Value, "gradcheck: fn returned an undefined tensor");
  std::vector<double> w(static_cast<size_t>(out.numel()));
  Generator gen(0x9c4ecc);  // fixed: the same check every run
  gen.normal(w.data(), static_cast<int64_t>(w.size()), 0.0, 1.0);
  std::vector<Tensor> saved_grads;
  for (const Tensor& in : inputs) {
    saved_grads.push_back(in.defined() ? in.grad() : Tensor());
    if (in.defined() && in.requires_grad()) in.set_grad(Tensor());
  }
  if (out.requires_grad()) {
    Tensor w_t = from_vector(w, out.shape(), out.device()).to(out.dtype());
    out.backward(w_t);
  }
  std::vector<std::vector<double>> analytic(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& in = inputs[i];
    if (!in.defined() || !in.requires_grad()) continue;
    analytic[i] = in.grad().defined() ? host_values(in.grad())
                                      : std::vector<double>(static_cast<size_t>(in.numel()), 0.0);
    in.set_grad(saved_grads[i]);
  }

  // Numeric: central differences, one element at a time, through a host copy of the input.
  GradcheckResult result;
  GradModeScope grad_off(false);
  auto objective = [&]() { return dot(host_values(fn(inputs)), w); };
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& in = inputs[i];
    if (!in.defined() || !in.requires_grad()) continue;
    std::vector<double> host = host_values(in);
    const Tensor original = from_vector(host, in.shape(), kCPU);
    for (size_t j = 0; j < host.size(); ++j) {
      const double x0 = host[j];
      host[j] = x0 + eps;
      in.copy_(from_vector(host, in.shape(), kCPU));
      const double f_plus = objective();
      host[j] = x0 - eps;
      in.copy_(from_vector(host, in.shape(), kCPU));
      const double f_minus = objective();
      host[j] = x0;
      const double numeric = (f_plus - f_minus) / (2.0 * eps);
      const double a = analytic[i][j];
      const double abs_err = std::abs(a - numeric);
      result.max_abs_error = std::max(result.max_abs_error, abs_err);
      result.max_rel_error =
          std::max(result.max_rel_error, abs_err / std::max(std::abs(numeric), 1e-12));
      if (result.ok && !(abs_err <= atol + rtol * std::abs(numeric))) {
        result.ok = false;
        std::ostringstream os;
        os.precision(10);
        os << "input " << i << " " << shape_str(in.shape()) << ", element " << j << ": analytic "
           << a << ", numeric " << numeric << " (|diff| " << abs_err << ")";
        result.message = os.str();
      }
    }
    in.copy_(original);
  }
  if (result.ok) {
    std::ostringstream os;
    os << "ok: max abs error " << result.max_abs_error << ", max rel error "
       << result.max_rel_error;
    result.message = os.str();
  }
  return result;
}

}  // namespace tandem::autograd
