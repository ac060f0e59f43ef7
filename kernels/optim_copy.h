#pragma once
// The weight copy an optimizer update may write beside the parameters (SgdParams::copy_into,
// AdamParams::copy_into; Note [the weight copy written by the update] in nn/optim/optimizer.h):
// the dispatch that the CPU and CUDA update kernels share.
#include <type_traits>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

namespace tandem::kernels {

// The copy's element type when there is no copy_into: the update stores nothing more, and
// compiles to the code it had before copies existed.
struct NoCopy {};
template <typename C>
inline constexpr bool kCopies = !std::is_same_v<C, NoCopy>;

// Calls fn(TypeTag<C>{}) with C the element type of `copy` (copy_into) for a parameter of type
// T, NoCopy for an undefined copy. C is never T (kernels::sgd_step and adam_step check it).
template <typename T, typename Fn>
void dispatch_copy(const Tensor& copy, const char* op, Fn&& fn) {
  if (!copy.defined()) return fn(TypeTag<NoCopy>{});
  dispatch_floating_bf16(copy.dtype(), op, [&](auto tag) {
    using C = typename decltype(tag)::type;
    if constexpr (std::is_same_v<C, T>) {
      TANDEM_THROW(DType, op, ": copy_into has the parameter's dtype ", dtype_name(copy.dtype()));
    } else {
      fn(tag);
    }
  });
}

// The copy's elements: C* for copy_into, null without one.
template <typename C>
C* copy_ptr(const Tensor& copy) {
  return copy.defined() ? static_cast<C*>(copy.raw_data()) : nullptr;
}

}  // namespace tandem::kernels
