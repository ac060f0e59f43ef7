#pragma once
// The autograd graph.
//
// Every differentiable op that sees an input requiring grad records a Node. The node holds
// one Edge per differentiable input (to the node that produced that input, or to the
// AccumulateGrad node of a leaf) and a backward function that maps the gradients of the
// node's outputs to the gradients of its inputs. Tensors point at their producing node
// through AutogradMeta (the opaque slot in TensorImpl).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem::autograd {

struct Node;

struct Edge {
  std::shared_ptr<Node> node;  // null: this input does not need a gradient
  uint32_t input_nr = 0;       // which output of `node` the input tensor is
  bool valid() const { return node != nullptr; }
};

using TensorList = std::vector<Tensor>;

struct Node : std::enable_shared_from_this<Node> {
  // Hands next_edges to an iterative deleter: dropping a 100k-node chain must not recurse
  // 100k destructors deep (Note [iterative graph destruction] in autograd/tensor_autograd.cpp).
  virtual ~Node();
  // Gradients w.r.t. the node's inputs (one per next_edges entry; undefined = zero) given the
  // gradients w.r.t. its outputs (one per output; undefined = zero).
  virtual TensorList apply(TensorList&& grad_outputs) = 0;
  virtual std::string name() const = 0;
  // Drops what backward captured (called after the node ran unless the graph is retained).
  virtual void release() {}

  std::vector<Edge> next_edges;
  uint32_t num_outputs = 1;
  uint64_t sequence_nr = 0;  // creation order; later nodes run first when both are ready

  // Tensor hooks (Tensor::register_hook) of this node's outputs; a leaf's hang on its
  // AccumulateGrad. Before apply, the engine passes the summed gradient of output `output_nr`
  // through each in registration order; a defined return value replaces it (Note [tensor
  // hooks] in autograd/engine.cpp). They live on the node, not the tensor: an activation's
  // hook fires even when the tensor itself is gone by the time backward runs.
  struct TensorHook {
    uint32_t output_nr;
    int id;
    std::function<Tensor(const Tensor&)> fn;
  };
  std::vector<TensorHook> tensor_hooks;
  // Outputs that keep their gradient (Tensor::retain_grad): after the tensor hooks, the
  // gradient of output `first` is added into the tensor's .grad, if the tensor still exists.
  std::vector<std::pair<uint32_t, std::weak_ptr<TensorImpl>>> retained_grads;
  // The dtype conversion's node (`to`): one input, whose gradient is the output's cast back.
  // weight_grad_destination looks through it (Note [gradients written in place]).
  bool dtype_conversion = false;
  // Note [gradient parts]: the node's backward adds a second gradient of an output itself
  // (take_gradient_part), so the engine passes it on unsummed rather than adding the two first.
  bool sums_gradient_parts = false;
  // Recorded only in anomaly mode (autograd/anomaly.h): the forward op and its input shapes,
  // so that a NaN in this node's backward can name what created the node.
  std::string anomaly_forward;
};

// A node whose backward is a lambda: the usual way to write a differentiable op.
struct FunctionNode : Node {
  using BackwardFn = std::function<TensorList(TensorList&&)>;
  FunctionNode(std::string name, BackwardFn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  TensorList apply(TensorList&& grads) override {
    TANDEM_CHECK(fn_ != nullptr, Error, name_,
                 ": backward through a graph whose saved tensors were already freed; pass "
                 "retain_graph=true to the first backward to run it twice");
    return fn_(std::move(grads));
  }
  std::string name() const override { return name_; }
  void release() override { fn_ = nullptr; }
  bool released() const { return fn_ == nullptr; }

 private:
  std::string name_;
  BackwardFn fn_;
};

// Per-tensor autograd state, kept in TensorImpl::autograd.
struct AutogradMeta : AutogradMetaBase {
  ~AutogradMeta() override;  // iterative deleter for grad_fn (see ~Node)
  bool requires_grad = false;
  Tensor grad;                    // leaves, and non-leaves after retain_grad()
  bool retains_grad = false;      // non-leaves: retain_grad() was called
  std::shared_ptr<Node> grad_fn;  // non-leaves: producing node
  uint32_t output_nr = 0;         // which output of grad_fn
  // Leaves: created lazily by gradient_edge and cached here. The accumulator refers back to
  // the leaf weakly, so leaf -> accumulator -> leaf is not an ownership cycle.
  std::shared_ptr<Node> grad_accumulator;
  // Note [gradients written in place]: grad_zero says .grad holds zeros that nothing has
  // written since (mark_grad_zero); grad_lent that a backward function was handed .grad to
  // write this leaf's gradient into (grad_destination) and AccumulateGrad has not run yet.
  bool grad_zero = false;
  bool grad_lent = false;
  // Called in registration order with the leaf's .grad once it is final in a backward pass.
  std::vector<std::pair<int, std::function<void(const Tensor&)>>> hooks;
  int next_hook_id = 0;
};

// The node at the end of every leaf's gradient path: accumulates into the leaf's .grad
// (`grad += g`; the first time a fresh contiguous copy, never an alias of the incoming
// buffer), then fires the leaf's hooks. Runs as soon as it is ready (sequence_nr = max), so
// each leaf's gradient becomes final as early as possible (what overlapped allreduce needs).
struct AccumulateGrad : Node {
  explicit AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf);
  TensorList apply(TensorList&& grads) override;
  std::string name() const override { return "AccumulateGrad"; }
  std::weak_ptr<TensorImpl> leaf;
};

// Note [gradients written in place]
// A leaf's gradient normally reaches .grad in two passes: the backward function of the op that
// used the leaf writes it into a fresh tensor, and AccumulateGrad adds that into .grad. When
// .grad is known to hold zeros -- a FlatBuffer has just zeroed the whole model's gradients, as
// the training steps do before every backward -- the add is a whole extra pass over every
// gradient (LeNet: 10 kernels of a replayed step). So:
//
// - mark_grad_zero(leaf) says that leaf's .grad holds zeros (FlatBuffer::zero_ calls it);
//   anything that writes .grad (AccumulateGrad, set_grad) clears it.
// - grad_destination(input_nr, ...), called by a backward function while the engine runs it,
//   returns the .grad of the leaf its input input_nr is (that input's edge leads straight to
//   the leaf's AccumulateGrad), if it is marked zero and has the shape, dtype, device and
//   layout asked for (packed NCHW-contiguous; or, with any_dense, any non-overlapping dense
//   layout -- a channels-last weight's .grad is channels-last -- for a caller that writes it
//   with copy_, which follows the strides); the function then writes the gradient there
//   instead of into a new tensor and returns that tensor as the input's gradient. Otherwise
//   (not a leaf, no mark, another layout) it returns an undefined tensor and the function
//   allocates as usual.
// - AccumulateGrad, given the lent .grad itself, has nothing to add. Given anything else (the
//   engine summed the lent tensor with another use of the same leaf, out of place; or a
//   tensor hook replaced it) it copies that into .grad, which then holds the whole gradient:
//   .grad was zero before it was lent.
//
// - A .grad lent and not accumulated by the end of the backward (a node threw, or a function
//   returned another gradient for that input and none reached the leaf) is zeroed again and
//   its mark dropped: what the two-pass way leaves, the zeros it held.
//
// The values are those of the two-pass way bit for bit (x + 0 = x). What differs: during the
// backward, before the leaf's AccumulateGrad runs, .grad already holds the new gradient, and
// writes into .grad between mark_grad_zero and the backward by other means than set_grad
// would be overwritten, not added to (FlatBuffer::zero_'s callers zero right before the
// forward). Backward functions that use it: linear (and linear + activation), conv2d, batch
// norm in training (gamma, beta), and the dtype conversion (an autocast weight's bfloat16
// gradient cast into its float32 .grad).
//
// - An autocast weight reaches its layer through the dtype conversion's node (a bfloat16 copy
//   of a float32 leaf), so the layer's kernels cannot write the leaf's .grad, another dtype:
//   the conversion's backward casts the layer's gradient into it afterwards. A layer's backward
//   function asks weight_grad_destination(input_nr, shape, device) instead: the .grad its input
//   input_nr's gradient ends in, lent as grad_destination lends it (any dense layout), reached
//   straight or through one dtype conversion of which this gradient is the only one (no other
//   node of this backward feeds it, nothing has arrived there, no hook on it). The function
//   writes its gradient into that tensor itself -- its kernels directly where dtype and layout
//   allow (direct_destination), else by copy_ from their result (written_into) -- and returns
//   the tensor, which the conversion passes on unchanged (is_lent_grad). The whole of a
//   weight's gradient is then written by one backward function, which may run all of it on the
//   side stream (Note [weight gradients on a second stream] in autograd/grad_stream.h). The
//   values are the same bits: the same kernels and the same cast, in another place.
void mark_grad_zero(const Tensor& leaf);
Tensor grad_destination(uint32_t input_nr, const Shape& shape, DType dtype, Device device, bool any_dense = false);
Tensor weight_grad_destination(uint32_t input_nr, const Shape& shape, Device device);
// `to` when a kernel computing in `dtype` can write it directly (that dtype, packed NCHW-contiguous), else undefined.
Tensor direct_destination(const Tensor& to, DType dtype);
// g delivered into `to` (copy_, unless g is `to` already) and `to` returned; g when `to` is undefined.
Tensor written_into(const Tensor& g, const Tensor& to);
// For the dtype conversion's backward: whether g is the lent .grad of the leaf at the running
// node's input input_nr (written there by the layer after the conversion).
bool is_lent_grad(uint32_t input_nr, const Tensor& g);

// Note [gradient parts]
// A tensor used twice gets two gradients, which the engine adds before the tensor's producer
// runs: a pass that reads both and writes the sum, which the producer's backward then reads
// again. In a ResNet every block's input is used twice (the convolution and the shortcut), and
// the sum is read by the previous block's batch-norm backward, whose first pass reads its
// gradient anyway: it can read the two and add them as it goes (ResNet-18, bfloat16: 8 adds of
// up to 25 MB a step, ~100 us on an H200). So a node with sums_gradient_parts set gets the
// first gradient of an output as usual and the second apart, a "part", that its backward takes
// with take_gradient_part(output_nr) and adds to the first itself, in the order the engine
// would have (first + part, rounded as BinaryOp::Add rounds it). A third gradient is added to
// the first as before and becomes the part in turn, so the sum is (g1 + g2) + g3 as ever: the
// same bits. The engine keeps a part apart only when it has the first one's dtype, device and
// strides (what a kernel reading both needs) and adds it itself when the node's output has a
// tensor hook or a retained gradient (they see the whole gradient). A part not taken by the
// time the backward returns is an error: a gradient silently dropped.
//
// The gradient part of output output_nr of the node running on this thread, handed over once
// (undefined: none, or not inside a backward function).
Tensor take_gradient_part(uint32_t output_nr);

// AutogradMeta of t, created if absent.
AutogradMeta& meta(const Tensor& t);
// AutogradMeta of t, or null.
AutogradMeta* meta_or_null(const Tensor& t);

// The edge a gradient for t should flow along (grad_fn or the leaf's accumulator), or an
// invalid edge when t does not require grad.
Edge gradient_edge(const Tensor& t);

// True when grad mode is on and any input requires grad.
bool any_requires_grad(std::initializer_list<const Tensor*> inputs);

// Attaches `node` as the producer of `outputs` (sets their grad_fn / output_nr and
// requires_grad) and wires its next_edges from `inputs`. Used by every differentiable op:
//   auto y = kernels::...;
//   if (any_requires_grad({&x})) record("Relu", {x}, {y}, [x](TensorList&& g) {...});
void record(std::shared_ptr<Node> node, const std::vector<Tensor>& inputs,
            const std::vector<Tensor>& outputs);
void record(const char* name, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs,
            FunctionNode::BackwardFn backward);

}  // namespace tandem::autograd
