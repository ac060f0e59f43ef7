#include "parallel/pipeline/microbatch.h"

#include "core/error.h"

namespace tandem::parallel::pipeline {

std::vector<int64_t> micro_batch_sizes(int64_t batch, int num_micro_batches) {
  TANDEM_CHECK(num_micro_batches >= 1, Value,
               "micro_batch_sizes: num_micro_batches must be >= 1, got ", num_micro_batches);
  const int64_t m = num_micro_batches;
  TANDEM_CHECK(m <= batch, Value, "micro_batch_sizes: ", m, " micro-batches for a batch of ", batch,
               " rows; every micro-batch needs at least one row");
  std::vector<int64_t> sizes(static_cast<size_t>(m), batch / m);
  for (int64_t i = 0; i < batch % m; ++i) ++sizes[static_cast<size_t>(i)];
  return sizes;
}

std::vector<Tensor> split_micro_batches(const Tensor& x, int num_micro_batches) {
  TANDEM_CHECK(x.defined() && x.dim() >= 1, Shape,
               "split_micro_batches: need a tensor with a batch dim, got ",
               x.defined() ? x.str() : "an undefined tensor");
  std::vector<Tensor> chunks;
  int64_t start = 0;
  for (int64_t rows : micro_batch_sizes(x.size(0), num_micro_batches)) {
    chunks.push_back(x.slice(0, start, start + rows));
    start += rows;
  }
  return chunks;
}

std::vector<double> micro_batch_weights(const std::vector<int64_t>& sizes) {
  int64_t batch = 0;
  for (int64_t s : sizes) batch += s;
  TANDEM_CHECK(batch > 0, Value, "micro_batch_weights: the chunks hold no rows");
  std::vector<double> w;
  for (int64_t s : sizes) w.push_back(double(s) / double(batch));
  return w;
}

}  // namespace tandem::parallel::pipeline
