#pragma once
// Micro-batches: one batch cut along dim 0 into M chunks that flow through the pipeline one
// after another, and the loss weights that make their summed gradients the whole batch's.
//
// Note [loss scaling for micro-batches]
// The loss function returns the mean loss over a chunk's n_m rows. The executor multiplies
// it by n_m / B before backward, and backward *accumulates* every chunk's gradient into the
// parameters' .grad:
//     sum_m (n_m / B) * grad(mean over chunk m) = grad(sum over all B rows / B),
// the gradient of the mean loss over the whole batch, as one device computes it, also when
// the chunks are uneven (the same rule as Note [loss scaling for uneven shards] in
// parallel/trainer.cpp, with micro-batches for shards). PyTorch's pipelining divides by M
// instead, which equals this only when B is a multiple of M. A loss that is a sum over rows
// (reduction "sum") must not be scaled: pass weights of 1.
//
// BatchNorm under micro-batches computes its statistics over each micro-batch, not over the
// whole batch (as GPipe and PyTorch do), and updates its running statistics once per
// micro-batch (num_batches_tracked grows by M a step): a model with BatchNorm trains
// differently split into M > 1 micro-batches than whole (tests/parallel/test_pipeline.cpp
// shows both). The equality tests use models without it.
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace tandem::parallel::pipeline {

// Chunk sizes for `batch` rows in M chunks, torch.tensor_split's rule: as even as possible,
// the first batch % M chunks one row larger (7 in 3 -> {3, 2, 2}). ValueError naming both
// numbers when M < 1 or M > batch (a micro-batch would be empty).
std::vector<int64_t> micro_batch_sizes(int64_t batch, int num_micro_batches);

// x cut along dim 0 into chunks of micro_batch_sizes(x.size(0), M) rows: views of x (no
// copy). Not differentiable: they are for a batch's inputs and targets, which need no
// gradient. ShapeError for a 0-d or undefined x.
std::vector<Tensor> split_micro_batches(const Tensor& x, int num_micro_batches);

// n_m / B for every chunk (Note [loss scaling for micro-batches]); they add up to 1.
std::vector<double> micro_batch_weights(const std::vector<int64_t>& sizes);

}  // namespace tandem::parallel::pipeline
