#pragma once
// The backward engine.
#include <functional>
#include <vector>

#include "autograd/node.h"

namespace tandem::autograd {

// Runs backward from `roots` with initial gradients `grad_roots` (undefined = ones for a
// one-element root). Iterative topological order (no recursion: deep graphs would overflow
// the stack); gradients for a node's output are summed before the node runs; leaf gradients
// are accumulated with += into .grad and the leaf's hooks fire once its gradient is final.
// The graph is freed unless retain_graph.
//
// Details a caller may rely on:
// - Ready nodes run latest-created first; a leaf's AccumulateGrad runs as soon as it is ready,
//   so each leaf's hooks fire as early as possible (FIFO among leaves: a deterministic order).
// - A node none of whose outputs received a gradient is skipped (zero in, zero out); a leaf
//   that receives no gradient keeps its .grad and its hooks do not fire.
// - Tensor hooks (Tensor::register_hook, retain_grad) run on a node's summed output gradients
//   just before the node runs, and may replace them (Note [tensor hooks] in engine.cpp).
// - Backward runs with grad mode off: hooks may call any op without growing a graph, and
//   gradients of gradients are not supported.
// - No host synchronization: every step enqueues kernels on the current streams.
// - Running backward again through a graph freed by an earlier backward throws Error.
void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots,
                  bool retain_graph = false);

// Queues fn to run once the backward pass in progress on this thread has finished every node
// (PyTorch's Variable._execution_engine.queue_callback): DistributedDataParallel uses it to
// launch what is left of its buckets and to check for unused parameters after the last hook.
// Callbacks run in queue order, with grad mode off, and may queue more. Error when no backward
// runs on this thread (call it from a hook or a node's backward).
void queue_callback(std::function<void()> fn);

}  // namespace tandem::autograd
