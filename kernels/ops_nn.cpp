// The dispatcher, the neural-network ops that are neither convolution, batch norm nor an
// optimizer step (kernels/ops_conv.cpp, ops_batchnorm.cpp, ops_optim.cpp): log-softmax and
// cross-entropy, row indexing. Same rules as ops.cpp: check, allocate on the inputs' device,
// make inputs contiguous where the backend needs it, dispatch.
#include "kernels/ops.h"

#include "kernels/ops_checks.h"

namespace tandem::kernels {

namespace {

using internal::check_dims;
using internal::check_floating;
using internal::check_shape;

void check_target(const char* op, const Tensor& target, int64_t n) {
  TANDEM_CHECK(target.dtype() == kInt64, DType, op, ": target must be int64, got ",
               dtype_name(target.dtype()));
  check_shape(op, target, {n}, "target");
}

}  // namespace

// ---- log-softmax and cross-entropy ------------------------------------------------------

Tensor log_softmax(const Tensor& x) {
  check_same_device("log_softmax", {&x});
  check_floating("log_softmax", x);
  check_dims("log_softmax", x, 2, "a 2-D [N, C] tensor");
  Tensor y(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).log_softmax(x.contiguous(), y);
  return y;
}

Tensor log_softmax_backward(const Tensor& dy, const Tensor& y) {
  const char* op = "log_softmax_backward";
  check_same_device(op, {&dy, &y});
  check_same_dtype(op, {&dy, &y});
  check_floating(op, y);
  check_dims(op, y, 2, "a 2-D [N, C] tensor");
  check_shape(op, dy, y.shape(), "dy");
  Tensor dx(y.shape(), y.dtype(), y.device());
  backend_for(y.device()).log_softmax_backward(dy.contiguous(), y.contiguous(), dx);
  return dx;
}

std::pair<Tensor, Tensor> cross_entropy(const Tensor& logits, const Tensor& target) {
  const char* op = "cross_entropy";
  check_same_device(op, {&logits, &target});
  check_floating(op, logits);
  check_dims(op, logits, 2, "logits [N, C]");
  check_target(op, target, logits.size(0));
  Tensor log_probs(logits.shape(), logits.dtype(), logits.device());
  Tensor loss(Shape{}, logits.dtype(), logits.device());
  backend_for(logits.device())
      .cross_entropy_forward(logits.contiguous(), target.contiguous(), log_probs, loss);
  return {loss, log_probs};
}

Tensor cross_entropy_backward(const Tensor& log_probs, const Tensor& target, const Tensor& dloss) {
  const char* op = "cross_entropy_backward";
  check_same_device(op, {&log_probs, &target, &dloss});
  check_same_dtype(op, {&log_probs, &dloss});
  check_floating(op, log_probs);
  check_dims(op, log_probs, 2, "log_probs [N, C]");
  check_target(op, target, log_probs.size(0));
  TANDEM_CHECK(dloss.numel() == 1, Shape, op, ": dloss must have one element, got ",
               shape_str(dloss.shape()));
  Tensor dlogits(log_probs.shape(), log_probs.dtype(), log_probs.device());
  backend_for(log_probs.device())
      .cross_entropy_backward(log_probs.contiguous(), target.contiguous(), dloss, dlogits);
  return dlogits;
}

void count_correct(const Tensor& logits, const Tensor& target, const Tensor& correct) {
  const char* op = "count_correct";
  check_same_device(op, {&logits, &target, &correct});
  check_floating(op, logits);
  check_dims(op, logits, 2, "logits [N, C]");
  check_target(op, target, logits.size(0));
  TANDEM_CHECK(correct.dtype() == kInt64 && correct.numel() == 1, DType, op,
               ": the counter must be a one-element int64 tensor, got ", correct.str());
  // bfloat16 logits (autocast) are counted in float32: every bfloat16 value is one, so the
  // argmax is the same.
  const Tensor l = logits.dtype() == kBFloat16 ? logits.to(kFloat32) : logits;
  backend_for(logits.device()).count_correct(l.contiguous(), target.contiguous(), correct);
}

// ---- indexing ---------------------------------------------------------------------------

Tensor index_select(const Tensor& x, const Tensor& index, const Tensor& into) {
  check_same_device("index_select", {&x, &index});
  TANDEM_CHECK(x.dim() >= 1, Shape, "index_select: cannot index a 0-d tensor");
  TANDEM_CHECK(index.dtype() == kInt64, DType, "index_select: index must be int64, got ",
               dtype_name(index.dtype()));
  check_dims("index_select", index, 1, "a 1-D index");
  Shape shape = x.shape();
  shape[0] = index.size(0);
  Tensor out = output_into("index_select", into, shape, x, "into");
  TANDEM_CHECK(!into.defined() || (into.storage() != x.storage() && into.storage() != index.storage()), Value,
               "index_select: into shares its memory with the input or the index (rows would be read after "
               "they are written)");
  backend_for(x.device()).index_select(x.contiguous(), index.contiguous(), out);
  return out;
}

namespace {
void check_index_add(const char* op, const Tensor& src, const Tensor& index, const Shape& shape) {
  check_same_device(op, {&src, &index});
  TANDEM_CHECK(!shape.empty(), Shape, op, ": the output must have at least one dim");
  TANDEM_CHECK(index.dtype() == kInt64, DType, op, ": index must be int64, got ", dtype_name(index.dtype()));
  check_dims(op, index, 1, "a 1-D index");
  Shape src_shape = shape;
  src_shape[0] = index.size(0);
  check_shape(op, src, src_shape, "src");
}
}  // namespace

Tensor index_add(const Tensor& src, const Tensor& index, const Shape& shape) {
  check_index_add("index_add", src, index, shape);
  Tensor out(shape, src.dtype(), src.device());
  out.zero_();
  backend_for(src.device()).index_add(src.contiguous(), index.contiguous(), out);
  return out;
}

void index_add_(const Tensor& out, const Tensor& index, const Tensor& src) {
  check_index_add("index_add_", src, index, out.shape());
  check_same_device("index_add_", {&out, &src});
  check_same_dtype("index_add_", {&out, &src});
  TANDEM_CHECK(out.is_contiguous(), Shape, "index_add_: out ", shape_str(out.shape()), " is not packed");
  TANDEM_CHECK(out.storage() != src.storage() && out.storage() != index.storage(), Value,
               "index_add_: out shares its memory with src or the index");
  backend_for(out.device()).index_add(src.contiguous(), index.contiguous(), out);
}

}  // namespace tandem::kernels
