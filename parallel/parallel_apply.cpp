#include "parallel/parallel_apply.h"

#include "core/error.h"

namespace tandem::parallel {

std::vector<Tensor> parallel_apply(DeviceWorkers& workers,
                                   const std::function<Tensor(size_t rank)>& fn) {
  std::vector<Tensor> results(workers.size());
  workers.run([&](size_t rank) { results[rank] = fn(rank); });
  return results;
}

std::vector<Tensor> parallel_apply(DeviceWorkers& workers, const Replicas& replicas,
                                   const std::vector<Tensor>& inputs) {
  TANDEM_CHECK(replicas.size() == workers.size() && inputs.size() == workers.size(), Value,
               "parallel_apply: ", replicas.size(), " replicas and ", inputs.size(),
               " inputs for ", workers.size(), " devices");
  return parallel_apply(workers, [&](size_t rank) { return replicas[rank]->forward(inputs[rank]); });
}

}  // namespace tandem::parallel
