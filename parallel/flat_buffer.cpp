#include "parallel/flat_buffer.h"

#include "core/error.h"

namespace tandem::parallel {

FlatBuffer::FlatBuffer(std::vector<Tensor> params) : params_(std::move(params)) {
  TANDEM_CHECK(!params_.empty(), Value, "FlatBuffer: no parameters");
  const Tensor& first = params_[0];
  int64_t total = 0;
  for (size_t k = 0; k < params_.size(); ++k) {
    const Tensor& p = params_[k];
    TANDEM_CHECK(p.defined(), Value, "FlatBuffer: parameter ", k, " is undefined");
    TANDEM_CHECK(p.device() == first.device(), Device, "FlatBuffer: parameter ", k, " is on ",
                 p.device().str(), " but parameter 0 is on ", first.device().str());
    TANDEM_CHECK(p.dtype() == first.dtype(), DType, "FlatBuffer: parameter ", k, " is ",
                 dtype_name(p.dtype()), " but parameter 0 is ", dtype_name(first.dtype()));
    total += p.numel();
  }
  DeviceGuard device(first.device());
  flat_ = zeros({total}, first.dtype(), first.device());
  int64_t offset = 0;
  for (const Tensor& p : params_) {
    views_.push_back(flat_.slice(0, offset, offset + p.numel()).view(p.shape()));
    offset += p.numel();
  }
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

void FlatBuffer::detach() const {
  for (const Tensor& p : params_) p.set_grad(Tensor());
}

}  // namespace tandem::parallel
