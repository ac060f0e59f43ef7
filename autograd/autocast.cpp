#include "autograd/autocast.h"

#include "autograd/ops.h"
#include "core/error.h"

namespace tandem {

namespace {
// Per host thread, like grad mode: one replica's thread never changes another's precision.
thread_local bool t_autocast_enabled = false;
thread_local DType t_autocast_dtype = kBFloat16;
thread_local const AutocastWeights* t_autocast_weights = nullptr;
}  // namespace

bool is_autocast_enabled() {
  return t_autocast_enabled;
}

DType autocast_dtype() {
  return t_autocast_dtype;
}

void set_autocast_enabled(bool enabled) {
  t_autocast_enabled = enabled;
}

void set_autocast_dtype(DType dtype) {
  TANDEM_CHECK(dtype == kBFloat16, DType, "autocast: the autocast dtype must be bfloat16, got ",
               dtype_name(dtype));
  t_autocast_dtype = dtype;
}

AutocastGuard::AutocastGuard(DType dtype, bool enabled)
    : prev_enabled_(t_autocast_enabled), prev_dtype_(t_autocast_dtype) {
  set_autocast_dtype(dtype);  // checks before anything changes
  set_autocast_enabled(enabled);
}

AutocastGuard::~AutocastGuard() {
  t_autocast_enabled = prev_enabled_;
  t_autocast_dtype = prev_dtype_;
}

Tensor autocast_input(const Tensor& x) {
  if (!t_autocast_enabled || !x.defined() || x.dtype() != kFloat32) return x;
  if (t_autocast_weights != nullptr && t_autocast_weights->dtype() == t_autocast_dtype) {
    if (const Tensor copy = t_autocast_weights->lookup(x); copy.defined()) return to_converted(x, copy);
  }
  return to(x, t_autocast_dtype);
}

AutocastWeights::AutocastWeights(const std::vector<Tensor>& params, DType dtype) : params_(params) {
  TANDEM_CHECK(dtype == kBFloat16, DType, "AutocastWeights: the copy's dtype must be bfloat16, got ",
               dtype_name(dtype));
  for (size_t i = 0; i < params.size(); ++i) {
    TANDEM_CHECK(params[i].defined() && params[i].dtype() == kFloat32, DType, "AutocastWeights: parameter ", i,
                 " is ", params[i].defined() ? params[i].str() : std::string("undefined"), ", not float32");
  }
  flat_ = contiguous_span(params);
  TANDEM_CHECK(flat_.defined(), Value, "AutocastWeights: the ", params.size(),
               " parameters do not lie back to back in one buffer (coalesce them first: parallel::coalesce)");
  copy_ = empty({flat_.numel()}, dtype, flat_.device());
  views_ = split_views(copy_, params);
}

std::optional<AutocastWeights> AutocastWeights::if_fits(const std::vector<Tensor>& params) {
  for (const Tensor& p : params) {
    if (!p.defined() || p.dtype() != kFloat32) return std::nullopt;
  }
  if (!contiguous_span(params).defined()) return std::nullopt;
  return std::optional<AutocastWeights>(std::in_place, params);
}

void AutocastWeights::refresh() {
  const Tensor span = contiguous_span(params_);
  TANDEM_CHECK(span.defined() && span.raw_data() == flat_.raw_data(), Value,
               "AutocastWeights::refresh: the parameters no longer lie where the copy was made for (moved to "
               "another device or storage since); make a new AutocastWeights");
  copy_.copy_(flat_);
}

Tensor AutocastWeights::lookup(const Tensor& p) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].same(p)) return views_[i];
  }
  return Tensor();
}

AutocastWeightsGuard::AutocastWeightsGuard(const AutocastWeights* weights) : prev_(t_autocast_weights) {
  t_autocast_weights = weights;
}

AutocastWeightsGuard::~AutocastWeightsGuard() {
  t_autocast_weights = prev_;
}

AutocastWeightsGuard refresh_and_install(std::optional<AutocastWeights>& weights, bool refresh) {
  if (weights && refresh) weights->refresh();
  return AutocastWeightsGuard(weights ? &*weights : nullptr);
}

Tensor autocast_float32(const Tensor& x) {
  if (!t_autocast_enabled || !x.defined() || x.dtype() != t_autocast_dtype) return x;
  return to(x, kFloat32);
}

}  // namespace tandem
