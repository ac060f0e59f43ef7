#pragma once
// DataLoader: minibatches of a TensorDataset, one epoch per range-for.
//
//   DataLoader loader(dataset, {.batch_size = 256, .shuffle = true, .device = Device::cuda(0)});
//   for (int e = 0; e < epochs; ++e)
//     for (const Batch& b : loader) { ... b.x ... b.y ... }
//
// The dataset is copied to options.device once, at construction. Each epoch draws its order
// on the host, uploads it once as one int64 tensor [N], and every batch is a slice of that
// tensor gathered with kernels::index_select on the device: no host synchronization per batch.
//
// Note [epoch seeding]: epoch k (0-based) is shuffled by a Generator seeded from
// (options.seed, k), so epochs differ from each other, yet the same seed replays the same
// sequence of epochs bit for bit, and set_epoch() resumes a run at any epoch.
//
// A DataLoader is not thread-safe. Each begin() starts a new epoch, so iterate it with a
// range-for (or one explicit begin()), not with algorithms that call begin() twice.
#include <cstdint>
#include <iterator>

#include "core/device.h"
#include "data/dataset.h"

namespace tandem::data {

struct DataLoaderOptions {
  int64_t batch_size = 64;  // 1..dataset size
  bool shuffle = true;      // false: samples in dataset order every epoch
  bool drop_last = false;   // drop the final batch when it is smaller than batch_size
  uint64_t seed = 0;        // see Note [epoch seeding]
  Device device = kCPU;     // where the data and batches live
};

class DataLoader {
 public:
  // Throws ValueError when batch_size is < 1 or larger than the dataset.
  DataLoader(const TensorDataset& dataset, DataLoaderOptions options);

  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = const Batch*;
    using reference = const Batch&;

    Iterator() = default;
    const Batch& operator*() const;  // gathers the batch on first access
    const Batch* operator->() const { return &**this; }
    Iterator& operator++();
    friend bool operator==(const Iterator& a, const Iterator& b) { return a.batch_ == b.batch_; }
    friend bool operator!=(const Iterator& a, const Iterator& b) { return !(a == b); }

   private:
    friend class DataLoader;
    Iterator(const DataLoader* loader, int64_t batch) : loader_(loader), batch_(batch) {}
    const DataLoader* loader_ = nullptr;
    int64_t batch_ = 0;
    mutable Batch current_;
    mutable bool loaded_ = false;
  };

  Iterator begin();  // starts the next epoch
  Iterator end() const { return Iterator(this, num_batches_); }

  // Batch b of the current epoch (0 <= b < num_batches()); begin() must have been called.
  Batch batch(int64_t b) const;

  int64_t num_batches() const { return num_batches_; }  // per epoch
  int64_t size() const { return dataset_.size(); }      // samples in the dataset
  // Epochs started so far; the current one (while iterating) is epoch() - 1.
  int64_t epoch() const { return epoch_; }
  // The next begin() starts epoch e (0-based), e.g. to resume a run.
  void set_epoch(int64_t e);
  const DataLoaderOptions& options() const { return options_; }
  const TensorDataset& dataset() const { return dataset_; }  // on options().device
  // The current epoch's sample order, int64 [N] on options().device.
  const Tensor& order() const { return order_; }

 private:
  TensorDataset dataset_;
  DataLoaderOptions options_;
  int64_t num_batches_ = 0;
  int64_t epoch_ = 0;
  Tensor order_;  // int64 [N]
};

}  // namespace tandem::data
