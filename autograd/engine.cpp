// The backward engine: dependency counting, then a ready-queue loop. No recursion and no host
// synchronization (every step is a kernel enqueued on the current stream).
#include "autograd/engine.h"

#include <queue>
#include <tuple>
#include <unordered_map>

#include "autograd/grad_mode.h"
#include "kernels/ops.h"

namespace tandem::autograd {

namespace {

struct NodeTask {
  std::shared_ptr<Node> node;
  TensorList grads;          // one slot per node output, summed as gradients arrive
  int64_t dependencies = 0;  // edges from not-yet-run nodes of this graph
};

using TaskMap = std::unordered_map<Node*, NodeTask>;

// Adds g into the input buffer slot `input_nr` of `task`. The first gradient is kept as is;
// later ones are summed out of place, because a backward may hand the same tensor to several
// inputs (add's gradient is g for both sides) and in-place summation would corrupt the others.
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
  slot = kernels::binary(BinaryOp::Add, slot, g);
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

  TaskMap tasks;
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
      input_grads = n->apply(std::move(grads));
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
  callbacks.run();
}

}  // namespace tandem::autograd
