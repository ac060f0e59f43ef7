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
// (options.seed, k) -- epoch_permutation(N, seed, k) in distributed_sampler.h -- so epochs
// differ from each other, yet the same seed replays the same sequence of epochs bit for bit,
// set_epoch() resumes a run at any epoch, and a DistributedSampler with the same seed deals
// out the very same order across ranks.
//
// Note [global batches across ranks]: with options.sampler set, batch_size is the *global*
// batch, the same number as on one process. Global batch k covers positions [kB, (k+1)B) of
// the sampler's epoch order (padded or truncated, total_size() entries); this rank's batch k
// is the positions in that range congruent to its rank mod num_replicas, i.e. consecutive
// entries of sampler->indices(). So the union of the ranks' batch k is the one-process batch
// k (when N is a multiple of num_replicas; otherwise the last batch also holds the padding),
// shard sizes within a global batch differ by at most one, and every rank gets the same
// number of batches -- ceil(total_size / B), or floor with drop_last -- so no rank waits on a
// step the others never take. When B is not a multiple of num_replicas, the last global
// batch can leave a rank with an empty shard (a Batch of 0 rows); use global_batch_rows() to
// scale a summed loss by the global batch, not by the local rows. With a sampler built with
// pad = false (evaluation) a rank whose shard of the last batch is empty simply has one batch
// fewer: every sample is then seen exactly once over all ranks.
//
// The loader reads the sampler's epoch at each begin() and never changes it: call
// sampler->set_epoch(e) yourself every epoch, as in PyTorch (forgetting it repeats the same
// order every epoch); DataLoader::set_epoch() only moves the loader's own counter.
// options.shuffle and options.seed are not used with a sampler: the sampler's own shuffle and
// seed decide the order.
//
// A DataLoader is not thread-safe. Each begin() starts a new epoch, so iterate it with a
// range-for (or one explicit begin()), not with algorithms that call begin() twice.
#include <cstdint>
#include <iterator>
#include <memory>
#include <utility>

#include "core/device.h"
#include "data/dataset.h"
#include "data/distributed_sampler.h"

namespace tandem::data {

struct DataLoaderOptions {
  int64_t batch_size = 64;  // 1..dataset size
  bool shuffle = true;      // false: samples in dataset order every epoch
  bool drop_last = false;   // drop the final batch when it is smaller than batch_size
  uint64_t seed = 0;        // see Note [epoch seeding]
  Device device = kCPU;     // where the data and batches live
  // One rank's shard of a multi-process job (null: the whole dataset). Its dataset_size must
  // be the dataset's; batch_size is then the global batch and must be at least num_replicas.
  // See Note [global batches across ranks].
  std::shared_ptr<DistributedSampler> sampler;
};

class DataLoader {
 public:
  // Throws ValueError when batch_size is < 1 or larger than the dataset, or (with a sampler)
  // below num_replicas or when the sampler is for a dataset of another size.
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
  // The same as dataset().get(batch_index(b)).
  Batch batch(int64_t b) const;
  // The dataset rows of batch b, int64 [rows] on options().device (a slice of order(), no
  // copy), for a caller that gathers the batch itself -- inside a CUDA graph, say.
  Tensor batch_index(int64_t b) const;

  // Batches per epoch; with a sampler the same on every rank, unless the sampler was built
  // with pad = false (then some ranks may have one less).
  int64_t num_batches() const { return num_batches_; }
  // Rows of batch b on this rank, and of global batch b over all ranks (the same without a
  // sampler); no device access.
  int64_t batch_rows(int64_t b) const;
  int64_t global_batch_rows(int64_t b) const;
  int64_t size() const { return dataset_.size(); }  // samples in the dataset
  // Epochs started so far; the current one (while iterating) is epoch() - 1.
  int64_t epoch() const { return epoch_; }
  // The next begin() starts epoch e (0-based) at batch first_batch of that epoch, e.g. to
  // resume a run: its batches are then exactly batches first_batch, first_batch + 1, ... of
  // the uninterrupted run's epoch e, since an epoch's order depends only on (seed, e) (Note
  // [epoch seeding]; with a sampler, on the sampler's seed and epoch, which the caller sets).
  // Later epochs start at batch 0. ValueError for e < 0 or first_batch outside
  // [0, num_batches()] (num_batches(): the epoch is over, begin() == end()).
  void set_epoch(int64_t e, int64_t first_batch = 0);
  // The batch the next begin() starts at (0 unless set_epoch said otherwise).
  int64_t first_batch() const { return first_batch_; }
  const DataLoaderOptions& options() const { return options_; }
  const TensorDataset& dataset() const { return dataset_; }  // on options().device
  // The current epoch's sample order, int64 [N] on options().device; with a sampler this
  // rank's indices, int64 [sampler->num_samples()].
  const Tensor& order() const { return order_; }

 private:
  // This rank's positions [first, last) in order_ for batch b (the whole batch without a
  // sampler).
  std::pair<int64_t, int64_t> batch_range(int64_t b) const;
  int64_t global_batches() const;  // ceil or floor of (epoch length / batch_size)

  TensorDataset dataset_;
  DataLoaderOptions options_;
  int64_t num_batches_ = 0;
  int64_t epoch_ = 0;
  int64_t first_batch_ = 0;
  Tensor order_;  // int64 [N], or [num_samples] with a sampler
};

}  // namespace tandem::data
