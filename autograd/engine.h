#pragma once
// The backward engine.
#include <vector>

#include "autograd/node.h"

namespace tandem::autograd {

// Runs backward from `roots` with initial gradients `grad_roots` (undefined = ones for a
// one-element root). Iterative topological order (no recursion: deep graphs would overflow
// the stack); gradients for a node's output are summed before the node runs; leaf gradients
// are accumulated with += into .grad and the leaf's hooks fire once its gradient is final.
// The graph is freed unless retain_graph.
void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots,
                  bool retain_graph = false);

}  // namespace tandem::autograd
