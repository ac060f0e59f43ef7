// The autograd members of Tensor (requires_grad, grad, backward, hooks, ...) and what they
// stand on, declared in autograd/node.h: per-tensor AutogradMeta, AccumulateGrad, graph
// recording, and the iterative destruction of graphs.
#include <atomic>
#include <limits>

#include "autograd/anomaly.h"
#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/grad_stream.h"
#include "autograd/node.h"
#include "kernels/ops.h"

namespace tandem {
namespace autograd {

// Note [iterative graph destruction]
// A graph is a chain of shared_ptrs: node -> next_edges -> node, and node -> saved tensor ->
// AutogradMeta::grad_fn -> node. Letting those destructors run naturally recurses once per
// node, so dropping a deep graph (a long RNN, a 100k-op test) overflows the stack. Instead
// every Node and AutogradMeta hands the nodes it owns to drop_node, which queues them on a
// thread-local list drained by the outermost call: destruction becomes a loop whose depth is
// bounded by one node, however long the chain.
namespace {
thread_local std::vector<std::shared_ptr<Node>>* t_pending = nullptr;

void drop_node(std::shared_ptr<Node>&& n) noexcept {
  if (!n) return;
  if (n.use_count() > 1) {  // not the last owner: nothing gets destroyed here
    n.reset();
    return;
  }
  if (t_pending != nullptr) {
    t_pending->push_back(std::move(n));
    return;
  }
  std::vector<std::shared_ptr<Node>> pending;
  t_pending = &pending;
  pending.push_back(std::move(n));
  while (!pending.empty()) {
    std::shared_ptr<Node> last = std::move(pending.back());
    pending.pop_back();
    last.reset();  // may queue more nodes onto `pending`
  }
  t_pending = nullptr;
}
}  // namespace

Node::~Node() {
  for (auto& e : next_edges) drop_node(std::move(e.node));
}

AutogradMeta::~AutogradMeta() {
  drop_node(std::move(grad_fn));
  drop_node(std::move(grad_accumulator));
}

AccumulateGrad::AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf_impl) : leaf(leaf_impl) {
  sequence_nr = std::numeric_limits<uint64_t>::max();
}

TensorList AccumulateGrad::apply(TensorList&& grads) {
  std::shared_ptr<TensorImpl> impl = leaf.lock();
  if (!impl || grads.empty() || !grads[0].defined()) return {};  // leaf gone / no gradient
  const Tensor t(impl);
  const Tensor& g = grads[0];
  TANDEM_CHECK(g.shape() == t.shape(), Shape, "AccumulateGrad: gradient ", shape_str(g.shape()),
               " for a leaf of shape ", shape_str(t.shape()));
  TANDEM_CHECK(g.device() == t.device(), Device, "AccumulateGrad: gradient on ", g.device().str(),
               " for a leaf on ", t.device().str());
  TANDEM_CHECK(g.dtype() == t.dtype(), DType, "AccumulateGrad: ", dtype_name(g.dtype()),
               " gradient for a ", dtype_name(t.dtype()), " leaf");
  AutogradMeta& m = meta(t);
  m.grad_zero = false;
  // A lent .grad may still be being written on a side stream (Note [weight gradients on a
  // second stream]): wait for it before a hook reads it or anything else is written there.
  if (m.grad_lent && (!m.hooks.empty() || !g.same(m.grad))) join_weight_grad_streams();
  if (m.grad_lent) {  // Note [gradients written in place]
    m.grad_lent = false;
    if (!g.same(m.grad)) m.grad.copy_(g);
  } else if (!m.grad.defined()) {
    // A fresh buffer: the incoming gradient may alias another node's gradient or an
    // expanded (stride 0) view, and hooks may modify .grad in place (allreduce).
    Tensor fresh = empty(t.shape(), t.dtype(), t.device());
    fresh.copy_(g);
    m.grad = fresh;
  } else {
    TANDEM_CHECK(m.grad.shape() == t.shape(), Shape, "AccumulateGrad: existing .grad ",
                 shape_str(m.grad.shape()), " for a leaf of shape ", shape_str(t.shape()));
    kernels::axpby_(1.0, g, 1.0, m.grad);
  }
  // Copy: a hook may register or remove hooks.
  const auto hooks = m.hooks;
  const Tensor final_grad = m.grad;
  for (const auto& [id, hook] : hooks) hook(final_grad);
  return {};
}

AutogradMeta& meta(const Tensor& t) {
  TANDEM_CHECK(t.defined(), Value, "autograd: undefined tensor");
  TensorImpl* impl = t.impl();
  if (!impl->autograd) impl->autograd = std::make_shared<AutogradMeta>();
  // AutogradMeta is the only type ever stored in the slot.
  return static_cast<AutogradMeta&>(*impl->autograd);
}

AutogradMeta* meta_or_null(const Tensor& t) {
  if (!t.defined() || !t.impl()->autograd) return nullptr;
  return static_cast<AutogradMeta*>(t.impl()->autograd.get());
}

Edge gradient_edge(const Tensor& t) {
  AutogradMeta* m = meta_or_null(t);
  if (m == nullptr) return {};
  if (m->grad_fn) return {m->grad_fn, m->output_nr};
  if (!m->requires_grad) return {};
  if (!m->grad_accumulator) m->grad_accumulator = std::make_shared<AccumulateGrad>(t.impl_ptr());
  return {m->grad_accumulator, 0};
}

bool any_requires_grad(std::initializer_list<const Tensor*> inputs) {
  if (!grad_enabled()) return false;
  for (const Tensor* t : inputs) {
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  }
  return false;
}

namespace {
std::atomic<uint64_t> g_next_sequence_nr{0};
}

void record(std::shared_ptr<Node> node, const std::vector<Tensor>& inputs,
            const std::vector<Tensor>& outputs) {
  if (!grad_enabled()) return;
  TANDEM_CHECK(node != nullptr, Value, "record: null node");
  if (AnomalyMode::is_enabled()) [[unlikely]]
    detail::anomaly_check_forward(*node, inputs, outputs);
  node->sequence_nr = g_next_sequence_nr.fetch_add(1, std::memory_order_relaxed);
  node->num_outputs = static_cast<uint32_t>(outputs.size());
  node->next_edges.clear();
  node->next_edges.reserve(inputs.size());
  for (const Tensor& in : inputs) node->next_edges.push_back(gradient_edge(in));
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    TANDEM_CHECK(out.defined(), Value, node->name(), ": undefined output ", i);
    for (const Tensor& in : inputs) {
      // Recording onto an input's own TensorImpl would turn that input into a non-leaf.
      TANDEM_CHECK(!out.same(in), Error, node->name(), ": output ", i,
                   " is the same TensorImpl as an input; return a fresh alias (detach())");
    }
    AutogradMeta& m = meta(out);
    m.requires_grad = true;
    m.grad_fn = node;
    m.output_nr = static_cast<uint32_t>(i);
  }
}

void record(const char* name, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs,
            FunctionNode::BackwardFn backward) {
  record(std::make_shared<FunctionNode>(name, std::move(backward)), inputs, outputs);
}

}  // namespace autograd

// ---- Tensor's autograd members ---------------------------------------------------------

bool Tensor::requires_grad() const {
  const autograd::AutogradMeta* m = autograd::meta_or_null(*this);
  return m != nullptr && m->requires_grad;
}

Tensor& Tensor::set_requires_grad(bool value) {
  TANDEM_CHECK(defined(), Value, "set_requires_grad on an undefined tensor");
  TANDEM_CHECK(!value || is_floating(dtype()), DType, "set_requires_grad: only floating tensors ",
               "can require grad, got ", dtype_name(dtype()), " ", str());
  if (!is_leaf()) {
    TANDEM_CHECK(value, Value, "set_requires_grad(false) on a non-leaf ", str(),
                 "; use detach() for a tensor without history");
    return *this;
  }
  autograd::meta(*this).requires_grad = value;
  return *this;
}

Tensor Tensor::grad() const {
  const autograd::AutogradMeta* m = autograd::meta_or_null(*this);
  return m != nullptr ? m->grad : Tensor();
}

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined()) {
    TANDEM_CHECK(g.shape() == shape(), Shape, "set_grad: gradient ", shape_str(g.shape()),
                 " for a tensor of shape ", shape_str(shape()));
    TANDEM_CHECK(g.device() == device(), Device, "set_grad: gradient on ", g.device().str(),
                 " for a tensor on ", device().str());
    TANDEM_CHECK(g.dtype() == dtype(), DType, "set_grad: ", dtype_name(g.dtype()),
                 " gradient for a ", dtype_name(dtype()), " tensor");
  } else if (autograd::meta_or_null(*this) == nullptr) {
    return;  // nothing to clear
  }
  autograd::AutogradMeta& m = autograd::meta(*this);
  m.grad = g;
  m.grad_zero = m.grad_lent = false;  // Note [gradients written in place]
}

bool Tensor::is_leaf() const {
  const autograd::AutogradMeta* m = autograd::meta_or_null(*this);
  return m == nullptr || m->grad_fn == nullptr;
}

void Tensor::backward(const Tensor& grad_output, bool retain_graph) const {
  TANDEM_CHECK(defined(), Value, "backward on an undefined tensor");
  TANDEM_CHECK(grad_output.defined() || numel() == 1, Value, "backward: ", str(),
               " is not a scalar; pass grad_output of shape ", shape_str(shape()));
  autograd::run_backward({*this}, {grad_output}, retain_graph);
}

Tensor Tensor::detach() const {
  if (!defined()) return Tensor();
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = impl_->storage;
  impl->shape = impl_->shape;
  impl->strides = impl_->strides;
  impl->offset = impl_->offset;
  impl->dtype = impl_->dtype;
  return Tensor(std::move(impl));
}

int Tensor::register_grad_hook(std::function<void(const Tensor&)> hook) const {
  TANDEM_CHECK(is_leaf(), Value, "register_grad_hook: ", str(),
               " is not a leaf; hooks fire when a leaf's gradient is final");
  TANDEM_CHECK(hook != nullptr, Value, "register_grad_hook: empty hook");
  autograd::AutogradMeta& m = autograd::meta(*this);
  const int id = m.next_hook_id++;
  m.hooks.emplace_back(id, std::move(hook));
  return id;
}

void Tensor::remove_grad_hook(int id) const {
  autograd::AutogradMeta* m = autograd::meta_or_null(*this);
  if (m == nullptr) return;
  std::erase_if(m->hooks, [id](const auto& h) { return h.first == id; });
}

}  // namespace tandem
