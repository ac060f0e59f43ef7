// The backward engine: dependency counting, then a ready-queue loop. No recursion and no host
// synchronization (every step is a kernel enqueued on the current stream).
#include "autograd/engine.h"

#include <queue>
#include <tuple>
#include <unordered_map>

#include "autograd/anomaly.h"
#include "autograd/grad_mode.h"
#include "autograd/grad_stream.h"
#include "kernels/ops.h"

namespace tandem::autograd {

namespace {

struct NodeTask {
  std::shared_ptr<Node> node;
  TensorList grads;          // one slot per node output, summed as gradients arrive
  TensorList parts;          // per output, a gradient not yet added to grads' (Note [gradient parts])
  int64_t dependencies = 0;  // edges from not-yet-run nodes of this graph
};

using TaskMap = std::unordered_map<Node*, NodeTask>;

// Whether the node may be handed g apart from `first`, an earlier gradient of the same output
// (Note [gradient parts]).
bool keeps_apart(const Node& node, const Tensor& first, const Tensor& g) {
  return node.sums_gradient_parts && node.tensor_hooks.empty() && node.retained_grads.empty() &&
         g.dtype() == first.dtype() && g.device() == first.device() && g.strides() == first.strides();
}

// Adds g into the input buffer slot `input_nr` of `task`. The first gradient is kept as is;
// later ones are summed out of place, because a backward may hand the same tensor to several
// inputs (add's gradient is g for both sides) and in-place summation would corrupt the others.
// A node that sums its gradient parts gets the last one apart (Note [gradient parts]).
void accumulate(NodeTask& task, uint32_t input_nr, Tensor&& g) {
  Node& node = *task.node;
  TANDEM_CHECK(input_nr < node.num_outputs, Error, "backward: ", node.name(), " has ",
               node.num_outputs, " outputs, got a gradient for output ", input_nr);
  if (task.grads.size() < node.num_outputs) task.grads.resize(node.num_outputs);
  Tensor& slot = task.grads[input_nr];
  if (!slot.defined()) {
    slot = std::move(g);
    return;
  }
  TANDEM_CHECK(slot.shape() == g.shape(), Shape, "backward: gradients for output ", input_nr,
               " of ", node.name(), " disagree in shape: ", shape_str(slot.shape()), " vs ",
               shape_str(g.shape()));
  // A leaf's gradient, or an autocast weight's on its way to the leaf, may have been written on
  // the side stream: join before adding (Note [weight gradients on a second stream]). Input
  // gradients never are, but what the side stream's kernels keep alive goes only at a join or
  // a release: left to the end of the backward, every layer's dy and input stayed -- ResNet-18's
  // peak (bf16, batch 256) rose from 728 to 832 MB. A second gradient arrives at each block's
  // input, so releasing there bounds what is kept (Note [releasing what the side stream kept]).
  if (node.dtype_conversion || dynamic_cast<const AccumulateGrad*>(&node) != nullptr) {
    join_weight_grad_streams();
  } else {
    release_weight_grad_inputs();
  }
  if (keeps_apart(node, slot, g)) {
    if (task.parts.size() < node.num_outputs) task.parts.resize(node.num_outputs);
    Tensor& part = task.parts[input_nr];
    if (part.defined()) slot = kernels::binary(BinaryOp::Add, slot, part);  // (g1 + g2) + g3, as ever
    part = std::move(g);
    return;
  }
  slot = kernels::binary(BinaryOp::Add, slot, g);
}

// Adds the parts still apart into their gradients (a hook registered since they arrived).
void add_parts(TensorList& grads, TensorList& parts) {
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].defined()) grads[i] = kernels::binary(BinaryOp::Add, grads[i], parts[i]);
    parts[i] = Tensor();
  }
}

// Every node reachable from the roots, with the number of edges that point at it.
void count_dependencies(TaskMap& tasks, const std::vector<Node*>& roots) {
  std::vector<Node*> stack(roots.begin(), roots.end());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges) {
      if (!e.valid()) continue;
      auto [it, inserted] = tasks.try_emplace(e.node.get());
      if (inserted) {
        it->second.node = e.node;
        stack.push_back(e.node.get());
      }
      ++it->second.dependencies;
    }
  }
}

bool any_defined(const TensorList& ts) {
  for (const Tensor& t : ts) {
    if (t.defined()) return true;
  }
  return false;
}

// The callbacks of the backward pass running on this thread (null outside one).
thread_local std::vector<std::function<void()>>* t_callbacks = nullptr;

// Installs a callback list for one run_backward; restores the outer one (a hook may run a
// nested backward) on the way out, also when a node throws.
class CallbackScope {
 public:
  CallbackScope() : prev_(t_callbacks) { t_callbacks = &callbacks_; }
  ~CallbackScope() { t_callbacks = prev_; }
  void run() {
    for (size_t i = 0; i < callbacks_.size(); ++i) {  // may grow while running
      auto fn = std::move(callbacks_[i]);
      fn();
    }
    callbacks_.clear();
  }

 private:
  std::vector<std::function<void()>> callbacks_;
  std::vector<std::function<void()>>* prev_;
};

// The leaves whose .grad grad_destination lent during this thread's run_backward (Note
// [gradients written in place]). One whose AccumulateGrad did not run by the end -- a node
// threw, or a backward function took the tensor and returned another gradient nowhere -- is
// zeroed again and its mark dropped, so .grad is what the two-pass way would have left: the
// zeros it held, the gradient never accumulated. Restores the outer list (a hook may run a
// nested backward) on the way out.
thread_local std::vector<std::weak_ptr<TensorImpl>>* t_lent = nullptr;
class LentGradScope {
 public:
  LentGradScope() : prev_(t_lent) { t_lent = &lent_; }
  ~LentGradScope() {
    try {
      finish();
    } catch (...) {  // unwinding already: the exception on its way out is the one to report
    }
    t_lent = prev_;
  }
  LentGradScope(const LentGradScope&) = delete;
  LentGradScope& operator=(const LentGradScope&) = delete;
  void finish() {
    for (const std::weak_ptr<TensorImpl>& weak : lent_) {
      const std::shared_ptr<TensorImpl> impl = weak.lock();
      AutogradMeta* m = impl ? meta_or_null(Tensor(impl)) : nullptr;
      if (m == nullptr || !m->grad_lent) continue;
      m->grad_lent = false;
      m->grad.zero_();
    }
    lent_.clear();
  }

 private:
  std::vector<std::weak_ptr<TensorImpl>> lent_;
  std::vector<std::weak_ptr<TensorImpl>>* prev_;
};

// Sets a thread-local pointer for a scope and restores the outer value at its end (a hook may
// run a nested backward, or a node's backward another node's).
template <typename T>
class ScopedPointer {
 public:
  ScopedPointer(T*& slot, T* value) : slot_(slot), prev_(slot) { slot_ = value; }
  ~ScopedPointer() { slot_ = prev_; }
  ScopedPointer(const ScopedPointer&) = delete;
  ScopedPointer& operator=(const ScopedPointer&) = delete;

 private:
  T*& slot_;
  T* prev_;
};

// The graph this thread's run_backward is running (for weight_grad_destination's look at a
// conversion's pending gradients).
thread_local TaskMap* t_tasks = nullptr;

// The node whose backward function this thread is running (for grad_destination).
thread_local Node* running_node = nullptr;

// Its gradient parts not yet taken (Note [gradient parts]).
thread_local TensorList* running_parts = nullptr;

// Note [tensor hooks]
// Tensor::register_hook stores its hook on the node that will receive the tensor's gradient:
// the producer (grad_fn, keyed by which output the tensor is) for a non-leaf, the
// AccumulateGrad for a leaf. By the time a node runs, the engine has summed every gradient of
// each of its outputs, so a hook sees the whole gradient of its tensor exactly once per
// backward, as PyTorch's tensor pre-hooks do, and whatever it returns is what the node (and
// so everything upstream, or the leaf's .grad) receives. retain_grad() is one more hook of
// that kind, run after the user's so that .grad shows the gradient they produced; it holds
// the tensor weakly (the node must not keep an activation alive).
void run_tensor_hooks(Node& n, TensorList& grads) {
  if (n.tensor_hooks.empty() && n.retained_grads.empty()) return;
  join_weight_grad_streams();  // a hook reads the gradient (Note [weight gradients on a second stream])
  const std::vector<Node::TensorHook> hooks = n.tensor_hooks;  // a hook may add or remove hooks
  for (const Node::TensorHook& h : hooks) {
    Tensor& g = grads.at(h.output_nr);
    if (!g.defined()) continue;
    Tensor replaced = h.fn(g);
    if (!replaced.defined()) continue;
    TANDEM_CHECK(replaced.shape() == g.shape(), Shape, "tensor hook ", h.id, " on output ",
                 h.output_nr, " of ", n.name(), " returned a gradient of shape ",
                 shape_str(replaced.shape()), " for a gradient of shape ", shape_str(g.shape()));
    TANDEM_CHECK(replaced.device() == g.device(), Device, "tensor hook ", h.id, " on ",
                 n.name(), " returned a gradient on ", replaced.device().str(), " for one on ",
                 g.device().str());
    TANDEM_CHECK(replaced.dtype() == g.dtype(), DType, "tensor hook ", h.id, " on ", n.name(),
                 " returned a ", dtype_name(replaced.dtype()), " gradient for a ",
                 dtype_name(g.dtype()), " one");
    g = std::move(replaced);
  }
  for (const auto& [output_nr, weak] : n.retained_grads) {
    const Tensor& g = grads.at(output_nr);
    std::shared_ptr<TensorImpl> impl = weak.lock();
    if (!g.defined() || !impl) continue;
    AutogradMeta& m = meta(Tensor(impl));
    if (m.grad.defined()) {
      m.grad = kernels::binary(BinaryOp::Add, m.grad, g);  // out of place: g may be shared
    } else {
      m.grad = g.clone();  // never an alias of g
    }
  }
}

}  // namespace

void queue_callback(std::function<void()> fn) {
  TANDEM_CHECK(t_callbacks != nullptr, Error,
               "queue_callback: no backward pass is running on this thread (call it from a "
               "gradient hook or a node's backward)");
  t_callbacks->push_back(std::move(fn));
}

void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots,
                  bool retain_graph) {
  TANDEM_CHECK(grad_roots.empty() || grad_roots.size() == roots.size(), Value,
               "backward: ", roots.size(), " roots but ", grad_roots.size(), " root gradients");
  // Backward functions are built from kernels:: ops, which never record; turning recording
  // off also keeps hooks that call differentiable ops from growing the graph.
  NoGradGuard no_grad;
  CallbackScope callbacks;
  LentGradScope lent;  // after the callbacks: ended before them, also on a throw
  // After the lent gradients: joined before they are zeroed again on a throw (Note [weight
  // gradients on a second stream]).
  WeightGradStreamScope side_streams;

  TaskMap tasks;
  const ScopedPointer<TaskMap> running_tasks(t_tasks, &tasks);
  std::vector<Node*> root_nodes;
  std::vector<std::pair<Edge, Tensor>> seeds;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    TANDEM_CHECK(root.defined(), Value, "backward: undefined root ", i);
    Edge edge = gradient_edge(root);
    TANDEM_CHECK(edge.valid(), Error, "backward: ", root.str(),
                 " does not require grad and has no grad_fn");
    Tensor g = grad_roots.empty() ? Tensor() : grad_roots[i];
    if (!g.defined()) {
      TANDEM_CHECK(root.numel() == 1, Value, "backward: ", root.str(),
                   " is not a scalar; pass a grad_output of shape ", shape_str(root.shape()));
      g = ones(root.shape(), root.dtype(), root.device());
    } else {
      TANDEM_CHECK(g.shape() == root.shape(), Shape, "backward: grad_output ", shape_str(g.shape()),
                   " for an output of shape ", shape_str(root.shape()));
      TANDEM_CHECK(g.device() == root.device(), Device, "backward: grad_output on ",
                   g.device().str(), " for an output on ", root.device().str());
      TANDEM_CHECK(g.dtype() == root.dtype(), DType, "backward: ", dtype_name(g.dtype()),
                   " grad_output for a ", dtype_name(root.dtype()), " output");
    }
    auto [it, inserted] = tasks.try_emplace(edge.node.get());
    if (inserted) {
      it->second.node = edge.node;
      root_nodes.push_back(edge.node.get());
    }
    seeds.emplace_back(std::move(edge), std::move(g));
  }
  count_dependencies(tasks, root_nodes);
  for (auto& [edge, g] : seeds) accumulate(tasks.at(edge.node.get()), edge.input_nr, std::move(g));

  // Ready nodes, latest-created first; FIFO among equal sequence numbers (the accumulators,
  // which all share the maximum) so the order of leaf hooks is deterministic.
  using Entry = std::tuple<uint64_t, int64_t, Node*>;  // sequence_nr, -arrival, node
  std::priority_queue<Entry> ready;
  int64_t arrivals = 0;
  auto push_ready = [&](Node* n) { ready.emplace(n->sequence_nr, -(arrivals++), n); };
  for (Node* n : root_nodes) {
    if (tasks.at(n).dependencies == 0) push_ready(n);
  }

  while (!ready.empty()) {
    Node* n = std::get<2>(ready.top());
    ready.pop();
    NodeTask& task = tasks.at(n);
    TensorList grads = std::move(task.grads);
    // A node none of whose outputs received a gradient contributes zero: skip it.
    TensorList input_grads;
    if (any_defined(grads)) {
      grads.resize(n->num_outputs);
      TensorList parts = std::move(task.parts);
      parts.resize(n->num_outputs);
      if (!n->tensor_hooks.empty() || !n->retained_grads.empty()) add_parts(grads, parts);
      run_tensor_hooks(*n, grads);
      {
        const ScopedPointer<Node> running(running_node, n);
        const ScopedPointer<TensorList> running_parts_of(running_parts, &parts);
        input_grads = n->apply(std::move(grads));
      }
      TANDEM_CHECK(!any_defined(parts), Error, "backward: ", n->name(),
                   " left a second gradient of an output unsummed (Note [gradient parts] in autograd/node.h)");
      if (AnomalyMode::is_enabled()) [[unlikely]] {
        join_weight_grad_streams();  // it reads the gradients, some perhaps written on a side stream
        detail::anomaly_check_backward(*n, input_grads);
      }
      TANDEM_CHECK(input_grads.empty() || input_grads.size() == n->next_edges.size(), Error,
                   "backward: ", n->name(), " returned ", input_grads.size(), " gradients for ",
                   n->next_edges.size(), " inputs");
    }
    if (!retain_graph) n->release();
    for (size_t i = 0; i < n->next_edges.size(); ++i) {
      const Edge& e = n->next_edges[i];
      if (!e.valid()) continue;
      NodeTask& next = tasks.at(e.node.get());
      if (i < input_grads.size() && input_grads[i].defined()) {
        accumulate(next, e.input_nr, std::move(input_grads[i]));
      }
      if (--next.dependencies == 0) push_ready(e.node.get());
    }
  }
  side_streams.join();  // everything after backward reads the gradients on the current stream
  lent.finish();         // before the callbacks, which may read the gradients
  callbacks.run();
}

void mark_grad_zero(const Tensor& leaf) {  // Note [gradients written in place]
  AutogradMeta* m = meta_or_null(leaf);
  if (m == nullptr || !m->grad.defined()) return;
  m->grad_zero = true;
  m->grad_lent = false;
}

namespace {

// The leaf whose AccumulateGrad input input_nr of node n leads to, and its meta; null when it is not one.
std::pair<std::shared_ptr<TensorImpl>, AutogradMeta*> leaf_at(const Node& n, uint32_t input_nr) {
  if (input_nr >= n.next_edges.size()) return {};
  const auto* acc = dynamic_cast<const AccumulateGrad*>(n.next_edges[input_nr].node.get());
  std::shared_ptr<TensorImpl> impl = acc != nullptr ? acc->leaf.lock() : nullptr;
  AutogradMeta* m = impl ? meta_or_null(Tensor(impl)) : nullptr;
  return {m != nullptr ? std::move(impl) : nullptr, m};
}

// grad_destination's lending, for node n's input input_nr (dtype null: the leaf's own).
Tensor lend(const Node& n, uint32_t input_nr, const Shape& shape, const DType* dtype, Device device, bool any_dense) {
  if (t_lent == nullptr) return {};
  auto [impl, m] = leaf_at(n, input_nr);
  if (m == nullptr || !m->grad_zero || m->grad_lent) return {};
  const Tensor& g = m->grad;
  if (g.shape() != shape || (dtype != nullptr && g.dtype() != *dtype) || g.device() != device) return {};
  if (!(any_dense ? g.is_non_overlapping_and_dense() : g.is_contiguous())) return {};
  m->grad_zero = false;
  m->grad_lent = true;
  t_lent->push_back(impl);
  return g;
}

}  // namespace

Tensor grad_destination(uint32_t input_nr, const Shape& shape, DType dtype, Device device, bool any_dense) {
  if (running_node == nullptr) return {};
  return lend(*running_node, input_nr, shape, &dtype, device, any_dense);
}

Tensor weight_grad_destination(uint32_t input_nr, const Shape& shape, Device device) {
  if (running_node == nullptr || input_nr >= running_node->next_edges.size()) return {};
  Node* next = running_node->next_edges[input_nr].node.get();
  if (next == nullptr || !next->dtype_conversion) {
    const DType* any = nullptr;  // a leaf used straight is of the input's own dtype
    return lend(*running_node, input_nr, shape, any, device, /*any_dense=*/true);
  }
  // Through the conversion only when this gradient will be all it receives, unseen by hooks.
  if (t_tasks == nullptr || !next->tensor_hooks.empty() || !next->retained_grads.empty()) return {};
  const auto it = t_tasks->find(next);
  if (it == t_tasks->end() || it->second.dependencies != 1 || any_defined(it->second.grads)) return {};
  const DType* leaf_dtype = nullptr;
  return lend(*next, 0, shape, leaf_dtype, device, /*any_dense=*/true);
}

Tensor direct_destination(const Tensor& to, DType dtype) {
  return to.defined() && to.dtype() == dtype && to.is_contiguous() ? to : Tensor();
}

Tensor written_into(const Tensor& g, const Tensor& to) {
  if (!to.defined() || !g.defined()) return g;
  if (!g.same(to)) to.copy_(g);
  return to;
}

Tensor take_gradient_part(uint32_t output_nr) {
  if (running_parts == nullptr || output_nr >= running_parts->size()) return {};
  Tensor part = std::move((*running_parts)[output_nr]);
  (*running_parts)[output_nr] = Tensor();
  return part;
}

bool is_lent_grad(uint32_t input_nr, const Tensor& g) {
  if (running_node == nullptr || !g.defined()) return false;
  const auto [impl, m] = leaf_at(*running_node, input_nr);
  return m != nullptr && m->grad_lent && m->grad.same(g);
}

}  // namespace tandem::autograd

// ---- Tensor's hooks on any tensor (Note [tensor hooks]) ---------------------------------

namespace tandem {

int Tensor::register_tensor_hook(std::function<Tensor(const Tensor&)> hook) const {
  TANDEM_CHECK(defined(), Value, "register_hook on an undefined tensor");
  TANDEM_CHECK(hook != nullptr, Value, "register_hook: empty hook");
  const autograd::Edge edge = autograd::gradient_edge(*this);
  TANDEM_CHECK(edge.valid(), Value, "register_hook: ", str(),
               " does not require grad; no gradient will flow into it");
  const int id = autograd::meta(*this).next_hook_id++;
  edge.node->tensor_hooks.push_back({edge.input_nr, id, std::move(hook)});
  return id;
}

void Tensor::remove_hook(int id) const {
  const autograd::Edge edge = autograd::gradient_edge(*this);
  if (!edge.valid()) return;
  std::erase_if(edge.node->tensor_hooks, [&](const autograd::Node::TensorHook& h) {
    return h.id == id && h.output_nr == edge.input_nr;
  });
}

void Tensor::retain_grad() const {
  TANDEM_CHECK(defined() && requires_grad(), Value, "retain_grad: ",
               defined() ? str() : std::string("undefined tensor"),
               " does not require grad; it will never have a gradient");
  if (is_leaf()) return;  // a leaf keeps its gradient anyway
  autograd::AutogradMeta& m = autograd::meta(*this);
  if (m.retains_grad) return;
  m.retains_grad = true;
  m.grad_fn->retained_grads.emplace_back(m.output_nr, impl_ptr());
}

bool Tensor::retains_grad() const {
  const autograd::AutogradMeta* m = autograd::meta_or_null(*this);
  return m != nullptr && m->retains_grad;
}

}  // namespace tandem
