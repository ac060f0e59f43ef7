// Tensor metadata and raw views. Copies and factories that need a kernel live in
// kernels/tensor_methods.cpp (core does not depend on kernels).
#include "core/tensor.h"

#include <algorithm>
#include <sstream>

namespace tandem {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Strides contiguous_strides(const Shape& s) {
  Strides st(s.size());
  int64_t acc = 1;
  for (int64_t i = static_cast<int64_t>(s.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= std::max<int64_t>(s[i], 1);
  }
  return st;
}

Strides strides_for(const Shape& s, MemoryFormat f) {
  if (f == MemoryFormat::Contiguous) return contiguous_strides(s);
  TANDEM_CHECK(s.size() == 4, Shape, "channels_last: expected a 4-D [N, C, H, W] shape, got ", shape_str(s));
  const int64_t c = std::max<int64_t>(s[1], 1), w = std::max<int64_t>(s[3], 1), h = std::max<int64_t>(s[2], 1);
  return {h * w * c, 1, w * c, c};
}

MemoryFormat suggest_memory_format(const Tensor& t) {
  if (t.dim() != 4) return MemoryFormat::Contiguous;
  const Strides cl = strides_for(t.shape(), MemoryFormat::ChannelsLast);
  return t.strides() == cl && cl != contiguous_strides(t.shape()) ? MemoryFormat::ChannelsLast
                                                                   : MemoryFormat::Contiguous;
}

namespace {

const TensorImpl& checked(const std::shared_ptr<TensorImpl>& impl) {
  TANDEM_CHECK(impl != nullptr, Value, "operation on an undefined tensor");
  return *impl;
}

int64_t wrap_dim(int64_t d, int64_t ndim, const char* op) {
  int64_t w = d < 0 ? d + ndim : d;
  TANDEM_CHECK(w >= 0 && w < ndim, Shape, op, ": dim ", d, " out of range for a ", ndim, "-d tensor");
  return w;
}

// A view sharing t's storage with new geometry.
Tensor make_view(const Tensor& t, Shape shape, Strides strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = t.storage();
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = t.dtype();
  return Tensor(std::move(impl));
}

}  // namespace

Tensor contiguous_span(const std::vector<Tensor>& tensors) {
  if (tensors.empty() || !tensors[0].defined()) return Tensor();
  const Tensor& first = tensors[0];
  int64_t end = first.offset();
  for (const Tensor& t : tensors) {
    if (!t.defined() || t.storage() != first.storage() || t.dtype() != first.dtype() || t.offset() != end ||
        !t.is_non_overlapping_and_dense()) {
      return Tensor();
    }
    end += t.numel();
  }
  return make_view(first, {end - first.offset()}, {1}, first.offset());
}

bool same_layout(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

std::vector<Tensor> split_views(const Tensor& flat, const std::vector<Tensor>& like) {
  int64_t total = 0;
  for (const Tensor& t : like) total += t.numel();
  TANDEM_CHECK(flat.dim() == 1 && flat.numel() == total && flat.is_contiguous(), Shape, "split_views: ",
               shape_str(flat.shape()), flat.is_contiguous() ? "" : " (strided)",
               " cannot be split into tensors of ", total, " elements in all");
  std::vector<Tensor> views;
  views.reserve(like.size());
  int64_t offset = 0;
  for (const Tensor& t : like) {
    // A dense tensor's view keeps its strides (a channels-last weight's gradient is
    // channels-last too); any other gets contiguous strides.
    const Strides st = t.is_non_overlapping_and_dense() ? t.strides() : contiguous_strides(t.shape());
    views.push_back(make_view(flat, t.shape(), st, flat.offset() + offset));
    offset += t.numel();
  }
  return views;
}

namespace {

// Resolves one -1 entry and checks the element count.
Shape infer_shape(const Shape& shape, int64_t numel, const char* op, const Shape& from) {
  Shape out = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      TANDEM_CHECK(infer < 0, Shape, op, ": only one dimension can be -1 in ", shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else {
      TANDEM_CHECK(out[i] >= 0, Shape, op, ": negative dimension in ", shape_str(shape));
      known *= out[i];
    }
  }
  if (infer >= 0) {
    TANDEM_CHECK(known > 0 && numel % known == 0, Shape, op, ": cannot view ", shape_str(from),
                 " as ", shape_str(shape));
    out[infer] = numel / known;
  }
  TANDEM_CHECK(shape_numel(out) == numel, Shape, op, ": cannot view ", shape_str(from), " (",
               numel, " elements) as ", shape_str(shape));
  return out;
}

}  // namespace

Tensor::Tensor(const Shape& shape, DType dtype, Device device, MemoryFormat format) {
  for (int64_t d : shape) TANDEM_CHECK(d >= 0, Shape, "negative dimension in shape ", shape_str(shape));
  impl_ = std::make_shared<TensorImpl>();
  impl_->strides = strides_for(shape, format);
  impl_->storage = std::make_shared<Storage>(device, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype));
  impl_->shape = shape;
  impl_->dtype = dtype;
}

const Shape& Tensor::shape() const { return checked(impl_).shape; }
const Strides& Tensor::strides() const { return checked(impl_).strides; }
int64_t Tensor::offset() const { return checked(impl_).offset; }
DType Tensor::dtype() const { return checked(impl_).dtype; }
Device Tensor::device() const { return checked(impl_).storage->device(); }
const std::shared_ptr<Storage>& Tensor::storage() const { return checked(impl_).storage; }

int64_t Tensor::size(int64_t d) const { return shape()[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const { return strides()[wrap_dim(d, dim(), "stride")]; }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no element to be out of place
  const auto& sh = shape();
  const auto& st = strides();
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (sh[i] == 1) continue;  // the stride of a size-1 dim does not matter
    if (st[i] != expected) return false;
    expected *= sh[i];
  }
  return true;
}

bool Tensor::is_contiguous(MemoryFormat format) const {
  if (format == MemoryFormat::Contiguous) return is_contiguous();
  if (dim() != 4) return false;
  if (numel() == 0) return true;
  const auto& sh = shape();
  const auto& st = strides();
  int64_t expected = 1;
  for (int64_t d : {1, 3, 2, 0}) {  // C, W, H, N: innermost first
    if (sh[d] == 1) continue;
    if (st[d] != expected) return false;
    expected *= sh[d];
  }
  return true;
}

bool Tensor::is_non_overlapping_and_dense() const {
  if (numel() == 0) return true;
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < dim(); ++d) {
    if (size(d) != 1) dims.push_back(d);
  }
  // Innermost first; ties (possible only for overlapping tensors) fail below.
  std::sort(dims.begin(), dims.end(), [&](int64_t a, int64_t b) { return stride(a) < stride(b); });
  int64_t expected = 1;
  for (int64_t d : dims) {
    if (stride(d) != expected) return false;
    expected *= size(d);
  }
  return true;
}

void Tensor::check_one_element(const char* op) const {
  TANDEM_CHECK(defined(), Value, op, ": undefined tensor");
  TANDEM_CHECK(numel() == 1, Shape, op, ": expected a one-element tensor, got ", shape_str(shape()));
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return "Tensor" + shape_str(shape()) + " " + dtype_name(dtype()) + " " + device().str();
}

// Every kernel takes its pointers here, on every device: the one place a read of a released
// storage (Note [releasing a storage] in core/storage.h) is caught, at the cost of one load.
void* Tensor::raw_data() const {
  const auto& impl = checked(impl_);
  TANDEM_CHECK(!impl.storage->released() || shape_numel(impl.shape) == 0, Value, "a kernel read ", str(),
               " whose storage was released (Storage::release) and not reallocated; under "
               "FullyShardedDataParallel a sharded parameter holds its bytes only during its unit's "
               "forward and backward and inside summon_full_params()");
  char* base = static_cast<char*>(impl.storage->data());
  if (base == nullptr) return nullptr;  // no bytes (an empty view of a released storage): nothing to offset
  return base + impl.offset * static_cast<int64_t>(dtype_size(impl.dtype));
}

Tensor Tensor::view(const Shape& shape) const {
  TANDEM_CHECK(is_contiguous(), Shape, "view: tensor ", shape_str(this->shape()),
               " is not contiguous; use reshape()");
  Shape s = infer_shape(shape, numel(), "view", this->shape());
  return make_view(*this, s, contiguous_strides(s), offset());
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (is_contiguous()) return view(shape);
  return contiguous().view(shape);
}

Tensor Tensor::flatten(int64_t start_dim) const {
  int64_t s = dim() == 0 ? 0 : wrap_dim(start_dim, dim(), "flatten");
  Shape out(shape().begin(), shape().begin() + s);
  out.push_back(-1);
  if (numel() == 0) out.back() = 0;
  return reshape(out);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end) const {
  d = wrap_dim(d, dim(), "slice");
  int64_t n = shape()[d];
  TANDEM_CHECK(0 <= start && start <= end && end <= n, Shape, "slice: [", start, ", ", end,
               ") out of range for dim ", d, " of size ", n, " in ", shape_str(shape()));
  Shape sh = shape();
  sh[d] = end - start;
  return make_view(*this, sh, strides(), offset() + start * strides()[d]);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_dim(d, dim(), "select");
  int64_t n = shape()[d];
  TANDEM_CHECK(index >= -n && index < n, Shape, "select: index ", index, " out of range for dim ",
               d, " of size ", n);
  if (index < 0) index += n;
  Shape sh = shape();
  Strides st = strides();
  int64_t off = offset() + index * st[d];
  sh.erase(sh.begin() + d);
  st.erase(st.begin() + d);
  return make_view(*this, sh, st, off);
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = wrap_dim(d0, dim(), "transpose");
  d1 = wrap_dim(d1, dim(), "transpose");
  Shape sh = shape();
  Strides st = strides();
  std::swap(sh[d0], sh[d1]);
  std::swap(st[d0], st[d1]);
  return make_view(*this, sh, st, offset());
}

Tensor Tensor::permute(const std::vector<int64_t>& dims) const {
  TANDEM_CHECK(static_cast<int64_t>(dims.size()) == dim(), Shape, "permute: ", dims.size(),
               " dims given for a ", dim(), "-d tensor");
  Shape sh(dims.size());
  Strides st(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], dim(), "permute");
    TANDEM_CHECK(!seen[d], Shape, "permute: dim ", d, " repeated");
    seen[d] = true;
    sh[i] = shape()[d];
    st[i] = strides()[d];
  }
  return make_view(*this, sh, st, offset());
}

Tensor Tensor::expand(const Shape& target) const {
  TANDEM_CHECK(static_cast<int64_t>(target.size()) >= dim(), Shape, "expand: cannot expand ",
               shape_str(shape()), " to ", shape_str(target));
  size_t lead = target.size() - shape().size();
  Shape sh = target;
  Strides st(target.size(), 0);
  for (size_t i = 0; i < shape().size(); ++i) {
    int64_t have = shape()[i], want = target[lead + i];
    if (have == want) {
      st[lead + i] = strides()[i];
    } else {
      TANDEM_CHECK(have == 1, Shape, "expand: cannot expand ", shape_str(shape()), " to ",
                   shape_str(target));
    }
  }
  return make_view(*this, sh, st, offset());
}

Tensor Tensor::unsqueeze(int64_t d) const {
  int64_t nd = dim() + 1;
  d = wrap_dim(d, nd, "unsqueeze");
  Shape sh = shape();
  Strides st = strides();
  int64_t inner = d < dim() ? st[d] * sh[d] : 1;
  sh.insert(sh.begin() + d, 1);
  st.insert(st.begin() + d, inner);
  return make_view(*this, sh, st, offset());
}

Tensor Tensor::squeeze(int64_t d) const {
  d = wrap_dim(d, dim(), "squeeze");
  TANDEM_CHECK(shape()[d] == 1, Shape, "squeeze: dim ", d, " of ", shape_str(shape()), " is not 1");
  return select(d, 0);
}

}  // namespace tandem
