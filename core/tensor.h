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
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
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
  template <typename T>
  std::vector<T> to_vector() const;  // contiguous copy in row-major order, any device

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
  std::shared_ptr<TensorImpl> impl_;
};

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
// A tensor holding a copy of host values (row-major), placed on `device`.
template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device = kCPU);
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
