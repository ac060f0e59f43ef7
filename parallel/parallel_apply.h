#pragma once
// parallel_apply: the same function on every device at once, one host thread per device.
//
// This is step 3 of a data-parallel step (docs/00-design.md, "Many devices in one process"): each replica runs its
// forward (and, in the trainer, its backward) on its own device, its own stream and its own
// host thread, so no device waits for another's kernel launches and virtual CPU devices
// really compute concurrently. The threads are the persistent DeviceWorkers.
#include <functional>
#include <vector>

#include "core/tensor.h"
#include "parallel/replicate.h"
#include "parallel/workers.h"

namespace tandem::parallel {

// Runs fn(rank) on every worker and returns the results by rank. Exceptions as in
// DeviceWorkers::run (rethrown with the failing device named).
std::vector<Tensor> parallel_apply(DeviceWorkers& workers,
                                   const std::function<Tensor(size_t rank)>& fn);

// replicas[i]->forward(inputs[i]) on worker i. ValueError unless there is one replica and one
// input per worker.
std::vector<Tensor> parallel_apply(DeviceWorkers& workers, const Replicas& replicas,
                                   const std::vector<Tensor>& inputs);

}  // namespace tandem::parallel
