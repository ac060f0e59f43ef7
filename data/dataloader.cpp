#include "data/dataloader.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "core/generator.h"

namespace tandem::data {

namespace {

// SplitMix64 finalizer: spreads (seed, epoch) over the whole 64-bit seed space so that
// neighbouring seeds and epochs give unrelated mt19937_64 streams.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

DataLoader::DataLoader(const TensorDataset& dataset, DataLoaderOptions options)
    : options_(options) {
  const int64_t n = dataset.size();
  TANDEM_CHECK(options.batch_size >= 1, Value, "DataLoader: batch_size must be >= 1, got ",
               options.batch_size);
  TANDEM_CHECK(options.batch_size <= n, Value, "DataLoader: batch_size ", options.batch_size,
               " is larger than the dataset (", n, " samples)");
  check_device_exists(options.device);
  dataset_ = dataset.to(options.device);  // once: every batch is gathered on the device
  num_batches_ = options.drop_last ? n / options.batch_size
                                   : (n + options.batch_size - 1) / options.batch_size;
}

void DataLoader::set_epoch(int64_t e) {
  TANDEM_CHECK(e >= 0, Value, "DataLoader::set_epoch: epoch must be >= 0, got ", e);
  epoch_ = e;
}

DataLoader::Iterator DataLoader::begin() {
  const int64_t n = size();
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (options_.shuffle) {
    // Note [epoch seeding]
    Generator gen(mix64(options_.seed ^ mix64(static_cast<uint64_t>(epoch_))));
    gen.permutation(order.data(), n);
  } else {
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  }
  // One upload per epoch; batches are slices of it.
  order_ = from_vector<int64_t>(order, {n}, options_.device);
  ++epoch_;
  return Iterator(this, 0);
}

Batch DataLoader::batch(int64_t b) const {
  TANDEM_CHECK(order_.defined(), Value, "DataLoader::batch: no epoch started (call begin())");
  TANDEM_CHECK(b >= 0 && b < num_batches_, Value, "DataLoader::batch: batch ", b, " outside [0, ",
               num_batches_, ")");
  const int64_t start = b * options_.batch_size;
  const int64_t end = std::min(start + options_.batch_size, size());
  return dataset_.get(order_.slice(0, start, end));
}

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
