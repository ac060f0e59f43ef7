#pragma once
// Tensor: a shared Storage plus a view (shape, strides, offset, dtype). Device = storage device.
//
// A Tensor is a cheap handle to a shared TensorImpl (copying a Tensor aliases it, like
// torch.Tensor). Views share storage; contiguous() copies only when needed.
//
// Members here never record autograd history: they are the raw view and data operations
// that kernels and layers are built from. The differentiable operations are the free
// functions in autograd/ops.h (tandem::add, tandem::matmul, tandem::reshape, ...).
// The autograd members (requires_grad, grad, backward, ...) are declared here and defined in
// autograd/, which keeps its per-tensor state in an opaque slot of TensorImpl.
//
// Where the members are defined (each group below names its file):
//   core/tensor.cpp              metadata, raw data access, raw views, contiguous_span/split_views
//   kernels/tensor_methods.cpp   copies, fills, host reads, the factories (they need a backend)
//   autograd/tensor_autograd.cpp the autograd members (register_hook's tensor hooks and
//                                retain_grad: autograd/engine.cpp, which runs them)
//   autograd/tensor_methods.cpp  PyTorch's method spellings (sum, mean, max, min, argmax, ...)
//   core/tensor_print.cpp        operator<< and repr
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/storage.h"

namespace tandem {

using Shape = std::vector<int64_t>;
using Strides = std::vector<int64_t>;

std::string shape_str(const Shape& s);  // "[256,1,28,28]"
int64_t shape_numel(const Shape& s);
Strides contiguous_strides(const Shape& s);

// Note [memory formats]: how a 4-D [N, C, H, W] tensor is laid out in memory, as PyTorch's
// torch.memory_format. The shape, the indexing and every op's meaning stay NCHW whatever the
// format; only the strides differ. Contiguous: row-major, strides (CHW, HW, W, 1).
// ChannelsLast: the channels of one pixel are adjacent, strides (HWC, 1, WC, C), the layout
// cuDNN's tensor-core convolutions work in (from NCHW they convert, twice per convolution).
// Ops keep the format of their inputs: a convolution whose input or weight is channels-last
// writes a channels-last output (Module::to(MemoryFormat) turns a model's 4-D weights), and
// elementwise ops, batch norm and their gradients follow their inputs, so a channels-last
// network runs end to end without a layout conversion. Backends that have no channels-last
// kernels (the CPU) get contiguous inputs and their result is converted, so the CPU stays the
// reference for both formats.
enum class MemoryFormat : uint8_t { Contiguous, ChannelsLast };
// The strides of a dense tensor of `s` in format f (ChannelsLast needs 4 dims).
Strides strides_for(const Shape& s, MemoryFormat f);

// Opaque per-tensor slot for autograd (defined in autograd/).
struct AutogradMetaBase {
  virtual ~AutogradMetaBase() = default;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Strides strides;  // in elements
  int64_t offset = 0;  // in elements
  DType dtype = DType::Float32;
  std::shared_ptr<AutogradMetaBase> autograd;
};

class Generator;

class Tensor {
 public:
  Tensor() = default;  // undefined tensor
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}
  // A new uninitialized tensor, contiguous or in the given memory format.
  Tensor(const Shape& shape, DType dtype, Device device,
         MemoryFormat format = MemoryFormat::Contiguous);

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same(const Tensor& o) const { return impl_ == o.impl_; }  // identity, not values

  // ---- metadata (core/tensor.cpp) ------------------------------------------
  const Shape& shape() const;
  const Strides& strides() const;
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t stride(int64_t d) const;
  int64_t numel() const { return shape_numel(shape()); }
  int64_t offset() const;
  DType dtype() const;
  Device device() const;
  size_t element_size() const { return dtype_size(dtype()); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  bool is_contiguous() const;
  // Whether the elements are laid out as `format` says (strides of size-1 dims do not
  // matter, so a [N, 1, H, W] tensor is both; ChannelsLast is false for other than 4 dims).
  bool is_contiguous(MemoryFormat format) const;
  // Non-overlapping and dense: the elements fill [offset, offset + numel) of the storage in
  // some order of the dims (any memory format, a transpose of a contiguous tensor).
  bool is_non_overlapping_and_dense() const;
  const std::shared_ptr<Storage>& storage() const;
  std::string str() const;  // "Tensor[2,3] float32 cuda:0"
  const Shape& sizes() const { return shape(); }  // libtorch's spelling of shape()

  // ---- raw data access (no sync: the caller knows the data is ready; core/tensor.cpp) ----
  void* raw_data() const;  // pointer to element 0 of the view
  template <typename T>
  T* data() const {
    TANDEM_CHECK(dtype_of<T>::value == dtype(), DType, "data<", dtype_name(dtype_of<T>::value),
                 ">() on a ", dtype_name(dtype()), " tensor");
    return static_cast<T*>(raw_data());
  }

  // ---- raw views (share storage; never record autograd; core/tensor.cpp) ------
  Tensor view(const Shape& shape) const;  // requires contiguity; one dim may be -1
  Tensor reshape(const Shape& shape) const;  // view when possible, else copy
  Tensor flatten(int64_t start_dim = 0) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end) const;  // [start, end) along dim
  Tensor select(int64_t dim, int64_t index) const;  // removes dim
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor expand(const Shape& shape) const;  // broadcast view (stride 0)
  Tensor unsqueeze(int64_t dim) const;
  Tensor squeeze(int64_t dim) const;

  // ---- copies (stream-ordered; never sync the host except into CPU memory from CUDA;
  //      kernels/tensor_methods.cpp) ----
  Tensor contiguous() const;
  Tensor contiguous(MemoryFormat format) const;  // this when already in format, else a copy
  // A copy in the same memory format (suggest_memory_format), as PyTorch's default
  // memory_format=torch.preserve_format.
  Tensor clone() const;
  Tensor to(Device device) const;  // same tensor when already there
  Tensor to(DType dtype) const;
  Tensor to(Device device, DType dtype) const;
  // Copies src into this (same shape; any devices and strides; converts dtype).
  void copy_(const Tensor& src) const;
  void fill_(double value) const;
  void zero_() const { fill_(0.0); }

  // ---- explicit host reads: these synchronize (kernels/tensor_methods.cpp) ------------
  double item() const;  // one-element tensor
  // libtorch's item<T>(): the one element converted to T (float, double, int64_t, uint8_t
  // exactly as to_vector<T> converts; another integral T or bool through int64_t; another
  // floating T through double). ShapeError unless the tensor has one element.
  template <typename T>
  T item() const {
    check_one_element("item");
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> ||
                  std::is_same_v<T, int64_t> || std::is_same_v<T, uint8_t>) {
      return to_vector<T>()[0];
    } else if constexpr (std::is_same_v<T, bool>) {
      return to_vector<int64_t>()[0] != 0;
    } else if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(to_vector<int64_t>()[0]);
    } else {
      static_assert(std::is_floating_point_v<T>, "item<T>: T must be an arithmetic type");
      return static_cast<T>(to_vector<double>()[0]);
    }
  }
  template <typename T>
  std::vector<T> to_vector() const;  // contiguous copy in row-major order, any device

  // ---- PyTorch's method spellings (autograd/tensor_methods.cpp) ---------------------------
  // The same operations as the free functions of autograd/ops.h (x.sum(1) is sum(x, {1})),
  // differentiable where those are; the index results (argmax, argmin, the second element of
  // max(dim) / min(dim)) are int64 and record nothing. Dims count from the end when negative.
  // sum of an integer tensor (uint8 included) is int64, as in PyTorch; mean needs a floating
  // tensor (DTypeError otherwise).
  Tensor sum() const;
  Tensor sum(int64_t dim, bool keepdim = false) const;
  Tensor sum(const std::vector<int64_t>& dims, bool keepdim = false) const;
  Tensor mean() const;
  Tensor mean(int64_t dim, bool keepdim = false) const;
  Tensor mean(const std::vector<int64_t>& dims, bool keepdim = false) const;
  // Without a dim: the maximum (minimum) of all elements, a 0-dim tensor. With one: the values
  // and the int64 indices of the first maximum (minimum) of each slice, as libtorch's
  // std::tuple; a NaN counts as the maximum and the minimum, as in PyTorch.
  Tensor max() const;
  std::tuple<Tensor, Tensor> max(int64_t dim, bool keepdim = false) const;
  Tensor min() const;
  std::tuple<Tensor, Tensor> min(int64_t dim, bool keepdim = false) const;
  // Index of the first maximum (minimum): without a dim, into the flattened tensor (0-dim
  // int64); with one, along it. Any dtype (integers are compared in float64).
  Tensor argmax() const;
  Tensor argmax(int64_t dim, bool keepdim = false) const;
  Tensor argmin() const;
  Tensor argmin(int64_t dim, bool keepdim = false) const;

  // ---- autograd (autograd/tensor_autograd.cpp) ---------------------------------------
  bool requires_grad() const;
  // Marks a leaf as needing a gradient. Throws on a non-floating tensor.
  Tensor& set_requires_grad(bool value = true);
  Tensor grad() const;  // undefined until backward writes it
  void set_grad(const Tensor& g) const;
  bool is_leaf() const;
  // Runs the backward pass from this tensor. For a non-scalar, pass grad_output.
  void backward(const Tensor& grad_output = Tensor(), bool retain_graph = false) const;
  Tensor detach() const;  // shares storage, no history
  // Calls hook(grad) when this leaf's gradient is final in a backward pass
  // (after accumulation into .grad). Returns an id for remove_grad_hook.
  int register_grad_hook(std::function<void(const Tensor&)> hook) const;
  void remove_grad_hook(int id) const;
  // PyTorch's Tensor.register_hook, on a leaf or a non-leaf that requires grad: hook(grad) is
  // called once per backward pass that reaches this tensor, with the gradient flowing into it
  // (summed over all its uses), before that gradient reaches a leaf's .grad or this tensor's
  // producer. A hook that returns a defined tensor (same shape, dtype and device) replaces the
  // gradient; one that returns void or an undefined tensor leaves it. Hooks run in
  // registration order with grad mode off. Returns an id for remove_hook. ValueError when the
  // tensor does not require grad.
  template <typename F>
  int register_hook(F&& hook) const {
    if constexpr (std::is_void_v<std::invoke_result_t<F&, const Tensor&>>) {
      return register_tensor_hook([h = std::forward<F>(hook)](const Tensor& g) mutable {
        h(g);
        return Tensor();
      });
    } else {
      return register_tensor_hook(std::function<Tensor(const Tensor&)>(std::forward<F>(hook)));
    }
  }
  int register_tensor_hook(std::function<Tensor(const Tensor&)> hook) const;
  void remove_hook(int id) const;
  // A non-leaf keeps its gradient: later backward passes accumulate (+=) into its .grad, after
  // its hooks ran. A no-op on a leaf. ValueError when the tensor does not require grad.
  void retain_grad() const;
  bool retains_grad() const;  // true after retain_grad() on a non-leaf

 private:
  void check_one_element(const char* op) const;  // ShapeError naming op and the shape
  std::shared_ptr<TensorImpl> impl_;
};

// PyTorch's printout (core/tensor_print.cpp): "tensor([[1.5000, 2.0000],\n        [3.0000, 4.0000]])",
// with PyTorch's rules: 4 decimals, "1." when every value is an integer, scientific notation
// when the magnitudes span more than 1000x (or exceed 1e8, or fall below 1e-4); more than
// 1000 elements are summarized to 3 edge items per dim around "..."; lines wrap at 80
// columns; then device='cuda:0' (when not cpu), dtype=torch.float64 (when not float32 or
// int64) and requires_grad=True. An undefined tensor prints "[ Tensor (undefined) ]".
// Synchronizes (it reads the values).
std::ostream& operator<<(std::ostream& out, const Tensor& t);
std::string repr(const Tensor& t);

// ---- factories (kernels/tensor_methods.cpp, except contiguous_span and split_views:
//      core/tensor.cpp) --------------------------------------------------------------------
Tensor empty(const Shape& shape, DType dtype = kFloat32, Device device = kCPU,
             MemoryFormat format = MemoryFormat::Contiguous);
Tensor zeros(const Shape& shape, DType dtype = kFloat32, Device device = kCPU);
Tensor ones(const Shape& shape, DType dtype = kFloat32, Device device = kCPU);
Tensor full(const Shape& shape, double value, DType dtype = kFloat32, Device device = kCPU);
// t with exactly the strides of `format` (strides_for): t itself when it has them, else a copy.
// Unlike t.contiguous(format), a tensor that size-1 dims let address its elements both ways (a
// [K, 1, 3, 3] weight) is restrided too, so suggest_memory_format then reports `format`.
Tensor restrided(const Tensor& t, MemoryFormat format);
// The format of t's strides: ChannelsLast when t is 4-D with exactly the strides of a
// channels-last tensor (strides_for) and not also those of a contiguous one; else Contiguous.
// An op writes its output in this format of its inputs (Note [memory formats]).
MemoryFormat suggest_memory_format(const Tensor& t);
// In t's memory format (suggest_memory_format).
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
// [start, end) with step, int64 by default.
Tensor arange(int64_t start, int64_t end, int64_t step = 1, DType dtype = kInt64, Device device = kCPU);
// Uniform in [lo, hi) / normal(mean, std) from the device's default generator (or `gen`).
Tensor rand(const Shape& shape, DType dtype = kFloat32, Device device = kCPU, Generator* gen = nullptr);
Tensor randn(const Shape& shape, DType dtype = kFloat32, Device device = kCPU, Generator* gen = nullptr);
Tensor uniform(const Shape& shape, double lo, double hi, DType dtype = kFloat32, Device device = kCPU,
               Generator* gen = nullptr);
Tensor normal(const Shape& shape, double mean, double stddev, DType dtype = kFloat32,
              Device device = kCPU, Generator* gen = nullptr);
// A tensor holding a copy of host values (row-major), placed on `device`. T is float, double,
// int64_t or uint8_t, and gives the dtype.
template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device = kCPU);
namespace detail {
// The element type a list of T is stored as: T itself for the four dtypes' types, int64_t
// for another integral type (int, long long), which tensor() and from_vector() take too.
template <typename T>
using stored_t = std::conditional_t<std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                        std::is_same_v<T, uint8_t> || !std::is_integral_v<T>,
                                    T, int64_t>;
template <typename T>
std::vector<stored_t<T>> stored_values(std::initializer_list<T> values) {
  static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>,
                "from_vector/tensor: the values must be numbers (float, double, integers)");
  return std::vector<stored_t<T>>(values.begin(), values.end());
}
}  // namespace detail
// from_vector({1.0f, 2.0f}, {2}): the type deduced from the list (float -> float32, double ->
// float64, int -> int64, uint8_t -> uint8).
template <typename T>
Tensor from_vector(std::initializer_list<T> values, const Shape& shape, Device device = kCPU) {
  return from_vector(detail::stored_values(values), shape, device);
}
// libtorch's torch::tensor({1.0f, 2.0f}): a 1-D tensor of the values, or a 2-D one of nested
// lists (rows of one length; ShapeError naming the row otherwise). As in libtorch, floating
// values give float32 (the default dtype: tensor({1.0, 2.0}) is float32 too) and integers
// int64; pass a dtype to choose (tensor({1.0, 2.0}, kFloat64)).
template <typename T>
Tensor tensor(std::initializer_list<T> values, DType dtype, Device device = kCPU) {
  return from_vector(detail::stored_values(values), {static_cast<int64_t>(values.size())}, device)
      .to(dtype);
}
template <typename T>
Tensor tensor(std::initializer_list<T> values, Device device = kCPU) {
  return tensor(values, std::is_floating_point_v<T> ? kFloat32 : dtype_of<detail::stored_t<T>>::value,
                device);
}
template <typename T>
Tensor tensor(std::initializer_list<std::initializer_list<T>> rows, DType dtype, Device device = kCPU) {
  const int64_t cols = rows.size() == 0 ? 0 : static_cast<int64_t>(rows.begin()->size());
  std::vector<detail::stored_t<T>> values;
  int64_t r = 0;
  for (const auto& row : rows) {
    TANDEM_CHECK(static_cast<int64_t>(row.size()) == cols, Shape, "tensor: row ", r, " has ",
                 row.size(), " values but row 0 has ", cols);
    const auto v = detail::stored_values(row);
    values.insert(values.end(), v.begin(), v.end());
    ++r;
  }
  return from_vector(values, {static_cast<int64_t>(rows.size()), cols}, device).to(dtype);
}
template <typename T>
Tensor tensor(std::initializer_list<std::initializer_list<T>> rows, Device device = kCPU) {
  return tensor(rows, std::is_floating_point_v<T> ? kFloat32 : dtype_of<detail::stored_t<T>>::value,
                device);
}
// A 1-D view of [total] elements covering `tensors` when they are, in this order, dense
// (is_non_overlapping_and_dense: contiguous, channels-last, ...) and back to back in one
// storage (a coalesced parameter list, a FlatBuffer's views); an undefined tensor otherwise or
// for an empty list. Pointer arithmetic only: elementwise work over two spans pairs the right
// elements only where their tensors have the same layout (same_layout).
Tensor contiguous_span(const std::vector<Tensor>& tensors);
// Same shape and the same stride in every dim of size > 1: a and b address their elements
// alike, so raw-memory kernels (the optimizer steps) may pair them up.
bool same_layout(const Tensor& a, const Tensor& b);
// The other way round: consecutive views of the 1-D tensor `flat`, view k shaped like like[k]
// (ShapeError unless flat has exactly their total number of elements).
std::vector<Tensor> split_views(const Tensor& flat, const std::vector<Tensor>& like);
// Wraps existing host memory without copying; `owner` keeps it alive.
Tensor from_blob(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> owner);

}  // namespace tandem
