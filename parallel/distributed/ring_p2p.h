#pragma once
// The teaching ring allreduce once more, now across processes: the same reduce-scatter +
// all-gather as the in-process RingCommunicator (parallel/comm_ring.cpp, Note [ring allreduce
// cost] there), with every chunk moved by ProcessGroup::send/recv instead of Tensor::copy_
// between devices. It is for reading and comparing, not for speed: pg.allreduce does the same
// job through Gloo's or NCCL's own tuned algorithms.
//
// CPU tensors on a "gloo" group only (DistError otherwise). On NCCL a step's send to the right
// neighbour and recv from the left one must be one group call (ncclGroupStart/End): issued
// apart, each rank's send waits for a recv that its neighbour's stream has queued behind that
// neighbour's own send, all the way round the ring, and nothing moves. The process group does
// not offer group calls yet.
#include "core/tensor.h"
#include "parallel/distributed/process_group.h"

namespace tandem::parallel::distributed {

// In place: every rank's t ends up holding the sum over all ranks of t. Every rank calls it
// with the same shape and dtype; t must be contiguous. Any numel (chunks may differ in length
// by one, or be empty) and any group size (size 1: nothing to do).
void allreduce_ring_p2p(ProcessGroup& pg, const Tensor& t);

}  // namespace tandem::parallel::distributed
