#include "parallel/flat_buffer.h"

#include "autograd/node.h"
#include "core/error.h"

namespace tandem::parallel {

int64_t checked_flat_numel(const std::vector<Tensor>& tensors, const char* who, const char* noun) {
  int64_t total = 0;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const Tensor& t = tensors[k];
    TANDEM_CHECK(t.defined(), Value, who, ": ", noun, " ", k, " is undefined");
    const Tensor& first = tensors[0];
    TANDEM_CHECK(t.device() == first.device(), Device, who, ": ", noun, " ", k, " is on ", t.device().str(),
                 " but ", noun, " 0 is on ", first.device().str());
    TANDEM_CHECK(t.dtype() == first.dtype(), DType, who, ": ", noun, " ", k, " is ", dtype_name(t.dtype()),
                 " but ", noun, " 0 is ", dtype_name(first.dtype()));
    total += t.numel();
  }
  return total;
}

FlatBuffer::FlatBuffer(std::vector<Tensor> params) : params_(std::move(params)) {
  TANDEM_CHECK(!params_.empty(), Value, "FlatBuffer: no parameters");
  const int64_t total = checked_flat_numel(params_, "FlatBuffer", "parameter");
  const Tensor& first = params_[0];
  DeviceGuard device(first.device());
  flat_ = zeros({total}, first.dtype(), first.device());
  views_ = split_views(flat_, params_);
}

void FlatBuffer::attach() const {
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!params_[k].grad().same(views_[k])) params_[k].set_grad(views_[k]);
  }
}

void FlatBuffer::collect() const {
  for (size_t k = 0; k < params_.size(); ++k) {
    Tensor g = params_[k].grad();
    if (!g.defined() || g.same(views_[k])) continue;
    views_[k].copy_(g);
    params_[k].set_grad(views_[k]);
  }
}

void FlatBuffer::zero_() const {
  if (!flat_.defined()) return;
  flat_.zero_();
  for (size_t k = 0; k < params_.size(); ++k) {
    if (params_[k].grad().same(views_[k])) autograd::mark_grad_zero(params_[k]);
  }
}

void FlatBuffer::detach() const {
  for (const Tensor& p : params_) p.set_grad(Tensor());
}

}  // namespace tandem::parallel
