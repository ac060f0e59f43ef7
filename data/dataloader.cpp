#include "data/dataloader.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace tandem::data {

DataLoader::DataLoader(const TensorDataset& dataset, DataLoaderOptions options)
    : options_(options) {
  const int64_t n = dataset.size();
  TANDEM_CHECK(options.batch_size >= 1, Value, "DataLoader: batch_size must be >= 1, got ",
               options.batch_size);
  TANDEM_CHECK(options.batch_size <= n, Value, "DataLoader: batch_size ", options.batch_size,
               " is larger than the dataset (", n, " samples)");
  if (const DistributedSampler* s = options.sampler.get()) {
    TANDEM_CHECK(s->dataset_size() == n, Value, "DataLoader: the sampler is for ",
                 s->dataset_size(), " samples but the dataset has ", n);
    // A global batch smaller than the world would leave some rank without a sample in every
    // step, not only in the last one.
    TANDEM_CHECK(options.batch_size >= s->num_replicas(), Value, "DataLoader: batch_size ",
                 options.batch_size, " (the global batch) is smaller than num_replicas ",
                 s->num_replicas());
  }
  check_device_exists(options.device);
  dataset_ = dataset.to(options.device);  // once: every batch is gathered on the device
  num_batches_ = global_batches();
  // An unpadded sampler (evaluation) may leave this rank nothing in the last global batch;
  // the rank then skips it. Only the last one can be short of num_replicas (batch_size >=
  // num_replicas). A padded sampler keeps the count equal on all ranks instead.
  const DistributedSampler* s = options.sampler.get();
  if (s && !s->pad() && !s->drop_last() && num_batches_ > 0) {
    const auto [first, last] = batch_range(num_batches_ - 1);
    if (first == last) --num_batches_;
  }
}

int64_t DataLoader::global_batches() const {
  const int64_t total = options_.sampler ? options_.sampler->total_size() : size();
  const int64_t b = options_.batch_size;
  return options_.drop_last ? total / b : (total + b - 1) / b;
}

int64_t DataLoader::global_batch_rows(int64_t b) const {
  TANDEM_CHECK(b >= 0 && b < global_batches(), Value, "DataLoader::global_batch_rows: batch ", b,
               " outside [0, ", global_batches(), ")");
  const int64_t total = options_.sampler ? options_.sampler->total_size() : size();
  const int64_t start = b * options_.batch_size;
  return std::min(start + options_.batch_size, total) - start;
}

int64_t DataLoader::batch_rows(int64_t b) const {
  TANDEM_CHECK(b >= 0 && b < num_batches_, Value, "DataLoader::batch_rows: batch ", b,
               " outside [0, ", num_batches_, ")");
  const auto [first, last] = batch_range(b);
  return last - first;
}

std::pair<int64_t, int64_t> DataLoader::batch_range(int64_t b) const {
  const int64_t start = b * options_.batch_size;
  const DistributedSampler* s = options_.sampler.get();
  if (!s) return {start, std::min(start + options_.batch_size, size())};
  // Note [global batches across ranks]: positions p of the epoch order in [start, end) with
  // p = rank + j * R are entries j in [ceil((start - rank) / R), ceil((end - rank) / R)) of
  // this rank's indices. Both numerators are > -R, so integer division is the ceiling.
  const int64_t end = std::min(start + options_.batch_size, s->total_size());
  const int64_t r = s->rank(), R = s->num_replicas();
  return {(start - r + R - 1) / R, (end - r + R - 1) / R};
}

void DataLoader::set_epoch(int64_t e, int64_t first_batch) {
  TANDEM_CHECK(e >= 0, Value, "DataLoader::set_epoch: epoch must be >= 0, got ", e);
  TANDEM_CHECK(first_batch >= 0 && first_batch <= num_batches_, Value,
               "DataLoader::set_epoch: first_batch ", first_batch, " outside [0, ", num_batches_,
               "]");
  epoch_ = e;
  first_batch_ = first_batch;
}

DataLoader::Iterator DataLoader::begin() {
  std::vector<int64_t> order;
  if (options_.sampler) {
    // The sampler's epoch, as the user set it; see Note [global batches across ranks].
    order = options_.sampler->indices();
  } else if (options_.shuffle) {
    order = epoch_permutation(size(), options_.seed, epoch_);  // Note [epoch seeding]
  } else {
    order.resize(static_cast<size_t>(size()));
    for (int64_t i = 0; i < size(); ++i) order[static_cast<size_t>(i)] = i;
  }
  // One upload per epoch; batches are slices of it.
  const auto n = static_cast<int64_t>(order.size());
  order_ = from_vector<int64_t>(order, {n}, options_.device);
  ++epoch_;
  const int64_t first = first_batch_;
  first_batch_ = 0;  // only the epoch set_epoch named starts late
  return Iterator(this, first);
}

Tensor DataLoader::batch_index(int64_t b) const {
  TANDEM_CHECK(order_.defined(), Value, "DataLoader::batch: no epoch started (call begin())");
  TANDEM_CHECK(b >= 0 && b < num_batches_, Value, "DataLoader::batch: batch ", b, " outside [0, ",
               num_batches_, ")");
  const auto [first, last] = batch_range(b);
  return order_.slice(0, first, last);  // 0 rows: a rank's empty shard of a short last batch
}

Batch DataLoader::batch(int64_t b) const { return dataset_.get(batch_index(b)); }

const Batch& DataLoader::Iterator::operator*() const {
  if (!loaded_) {
    current_ = loader_->batch(batch_);
    loaded_ = true;
  }
  return current_;
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  ++batch_;
  loaded_ = false;
  current_ = Batch{};
  return *this;
}

}  // namespace tandem::data
