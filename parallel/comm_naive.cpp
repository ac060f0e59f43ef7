// The naive allreduce: gather to device 0, sum there, send the sum back. Every byte crosses
// device 0's link twice per other device, and the other links idle; compare comm_ring.cpp.
#include "kernels/ops.h"
#include "parallel/comm.h"

namespace tandem::parallel {

void NaiveCommunicator::allreduce_sum(const std::vector<Tensor>& ts) {
  check_tensors("allreduce_sum", ts);
  if (ts.size() == 1) return;
  reduce_sum(ts, 0);  // everything to device 0, added there
  for (size_t i = 1; i < ts.size(); ++i) ts[i].copy_(ts[0]);
}

void NaiveCommunicator::broadcast(const std::vector<Tensor>& ts, size_t root) {
  check_tensors("broadcast", ts);
  check_root("broadcast", root);
  for (size_t i = 0; i < ts.size(); ++i) {
    if (i != root) ts[i].copy_(ts[root]);
  }
}

}  // namespace tandem::parallel
