#pragma once
// DistributedSampler: which samples each rank of a multi-process job reads.
//
// PyTorch's arguments and semantics: every epoch draws one order of the whole dataset -- the
// same on every rank, from (seed, epoch) -- and rank r takes positions r, r + R, r + 2R, ...
// of it (R = num_replicas), so the ranks' shards partition the epoch:
//
//   padded (default)   the order is extended to a multiple of R by repeating it from the start,
//                      so every rank has num_samples() = ceil(N / R) indices; the repeated ones
//                      are the only duplicates.
//   drop_last          the order is cut to a multiple of R: every rank has floor(N / R) indices
//                      and the last N mod R samples of the order are not seen that epoch.
//   pad = false        neither (for evaluation): each sample is on exactly one rank, once, and
//                      ranks hold ceil((N - r) / R) indices, so they may differ by one. Ignored
//                      with drop_last.
//
// Call set_epoch(e) at the start of every epoch, as in PyTorch: the sampler never advances by
// itself, so forgetting it repeats epoch 0's order every epoch.
//
//   auto sampler = std::make_shared<DistributedSampler>(train.size(), env.world_size, env.rank);
//   DataLoader loader(train, {.batch_size = 256, .sampler = sampler});  // 256: the global batch
//   for (int e = 0; e < epochs; ++e) {
//     sampler->set_epoch(e);
//     for (const Batch& b : loader) { ... }
//   }
//
// The shuffled order is epoch_permutation(N, seed, epoch), the one a plain DataLoader uses for
// the same seed and epoch (Note [epoch seeding] in dataloader.h), so R ranks with global batch
// B see the same global batches as one process with batch B.
#include <cstdint>
#include <vector>

namespace tandem::data {

// The shuffled order of epoch `epoch` (0-based) of n samples: a permutation of [0, n) drawn by
// a Generator seeded from (seed, epoch). The same arguments give the same permutation on every
// machine and in every process. See Note [epoch seeding].
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch);

class DistributedSampler {
 public:
  // Throws ValueError naming the value when dataset_size < 0, num_replicas < 1, or rank is not
  // in [0, num_replicas).
  DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false, bool pad = true);

  // The epoch whose order indices() returns (0-based); the DataLoader only reads it.
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }

  // This rank's number of indices per epoch (the same on every rank unless pad is false).
  int64_t num_samples() const { return num_samples_; }
  // Length of the whole epoch order over all ranks: ceil(N/R)*R padded, floor(N/R)*R with
  // drop_last, N without padding.
  int64_t total_size() const { return total_size_; }

  // The whole epoch order (total_size() entries) that the ranks deal out round-robin.
  std::vector<int64_t> epoch_order() const;
  // This rank's indices for the current epoch: epoch_order() at positions rank, rank + R, ...
  std::vector<int64_t> indices() const;

  int64_t dataset_size() const { return dataset_size_; }
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }
  bool shuffle() const { return shuffle_; }
  uint64_t seed() const { return seed_; }
  bool drop_last() const { return drop_last_; }
  bool pad() const { return pad_; }

 private:
  int64_t dataset_size_;
  int64_t num_replicas_;
  int64_t rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  bool pad_;
  int64_t epoch_ = 0;
  int64_t num_samples_ = 0;
  int64_t total_size_ = 0;
};

}  // namespace tandem::data
