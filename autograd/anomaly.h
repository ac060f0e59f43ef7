#pragma once
// Anomaly mode, PyTorch's torch.autograd.detect_anomaly / set_detect_anomaly: a debugging aid
// that turns the first NaN or Inf of a training step into an error naming where it came from.
//
//   {
//     autograd::DetectAnomalyGuard anomaly;  // this thread, this scope
//     Tensor loss = cross_entropy(model.forward(x), y);
//     loss.backward();
//   }
//
// While a guard is alive on a thread:
//  - forward: every op that records autograd history (grad mode on, an input requires grad)
//    checks its outputs; the first output holding a NaN or Inf throws AnomalyError naming the
//    op, its input shapes, the output and the first bad element:
//      "anomaly: forward op Log returned nan in output 0 [3] float64 (element 1); inputs:
//       [3] float64"
//  - backward: every node checks the gradients it returns; the first NaN or Inf throws
//    AnomalyError naming the backward node and the forward op that created it:
//      "anomaly: backward node SqrtBackward returned inf in its gradient for input 0 [3]
//       float64 (element 0); created by forward op Sqrt with inputs: [3] float64"
//    (a node recorded while the mode was off names only itself).
// The throw leaves the graph and the leaves' .grad as they were when it happened.
//
// Cost: off, one thread-local branch per recorded op and per backward node. On, each checked
// tensor is scanned on the host; a CUDA tensor (or one on a virtual CPU device) is copied to
// the CPU first, which synchronizes the host with its stream. That breaks "forward and
// backward never synchronize the host" (docs/00-design.md, invariant 3) on purpose, and is acceptable
// only in anomaly mode: leave it off for timing. For the same reason the mode does not mix with
// CUDA graph capture (core/cuda_graph.h): a host read during a capture fails. Integer tensors
// are never anomalous.
//
// The mode is thread-local, like NoGradGuard: threads that run replicas (DataParallel,
// parallel_apply) are covered only when they hold a guard of their own.
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace tandem::autograd {

// A NaN or Inf found in anomaly mode.
class AnomalyError : public tandem::detail::ErrorOf<AnomalyError, Error> {
  using ErrorOf::ErrorOf;
};

namespace detail {
extern constinit thread_local bool t_anomaly_enabled;
}  // namespace detail

// PyTorch's torch::autograd::AnomalyMode, per thread.
struct AnomalyMode {
  static bool is_enabled() { return detail::t_anomaly_enabled; }
  static void set_enabled(bool enabled) { detail::t_anomaly_enabled = enabled; }
};

// Turns anomaly mode on for this thread until the guard dies (guards nest; the previous state
// comes back).
class DetectAnomalyGuard {
 public:
  DetectAnomalyGuard() : prev_(AnomalyMode::is_enabled()) { AnomalyMode::set_enabled(true); }
  ~DetectAnomalyGuard() { AnomalyMode::set_enabled(prev_); }
  DetectAnomalyGuard(const DetectAnomalyGuard&) = delete;
  DetectAnomalyGuard& operator=(const DetectAnomalyGuard&) = delete;

 private:
  bool prev_;
};

struct Node;

// The checks behind the mode, called by record() and the engine only when it is on.
namespace detail {
// Notes the forward op's inputs on `node` and throws AnomalyError for a non-finite output.
void anomaly_check_forward(Node& node, const std::vector<Tensor>& inputs,
                           const std::vector<Tensor>& outputs);
// Throws AnomalyError for a non-finite gradient that `node`'s backward returned.
void anomaly_check_backward(const Node& node, const std::vector<Tensor>& input_grads);
}  // namespace detail

}  // namespace tandem::autograd
