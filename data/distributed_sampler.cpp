#include "data/distributed_sampler.h"

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

std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  TANDEM_CHECK(n >= 0, Value, "epoch_permutation: n must be >= 0, got ", n);
  TANDEM_CHECK(epoch >= 0, Value, "epoch_permutation: epoch must be >= 0, got ", epoch);
  std::vector<int64_t> order(static_cast<size_t>(n));
  // Note [epoch seeding]: this exact seed derivation is what makes a one-process DataLoader and
  // every rank's sampler agree; changing it changes every shuffled run.
  Generator gen(mix64(seed ^ mix64(static_cast<uint64_t>(epoch))));
  gen.permutation(order.data(), n);
  return order;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank,
                                       bool shuffle, uint64_t seed, bool drop_last, bool pad)
    : dataset_size_(dataset_size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last),
      pad_(pad) {
  TANDEM_CHECK(dataset_size >= 0, Value, "DistributedSampler: dataset_size must be >= 0, got ",
               dataset_size);
  TANDEM_CHECK(num_replicas >= 1, Value, "DistributedSampler: num_replicas must be >= 1, got ",
               num_replicas);
  TANDEM_CHECK(rank >= 0, Value, "DistributedSampler: rank must be >= 0, got ", rank);
  TANDEM_CHECK(rank < num_replicas, Value, "DistributedSampler: rank ", rank,
               " is not below num_replicas ", num_replicas);
  const int64_t n = dataset_size, r = num_replicas;
  if (drop_last) {
    total_size_ = n / r * r;
    num_samples_ = n / r;
  } else if (pad) {
    num_samples_ = (n + r - 1) / r;
    total_size_ = num_samples_ * r;
  } else {
    total_size_ = n;
    num_samples_ = (n - rank + r - 1) / r;  // positions rank, rank + r, ... below n
  }
}

void DistributedSampler::set_epoch(int64_t epoch) {
  TANDEM_CHECK(epoch >= 0, Value, "DistributedSampler::set_epoch: epoch must be >= 0, got ", epoch);
  epoch_ = epoch;
}

std::vector<int64_t> DistributedSampler::epoch_order() const {
  std::vector<int64_t> order;
  if (shuffle_) {
    order = epoch_permutation(dataset_size_, seed_, epoch_);
  } else {
    order.resize(static_cast<size_t>(dataset_size_));
    for (int64_t i = 0; i < dataset_size_; ++i) order[static_cast<size_t>(i)] = i;
  }
  const size_t n = order.size(), total = static_cast<size_t>(total_size_);
  if (total <= n) {
    order.resize(total);  // drop_last (or nothing to do)
  } else {
    // Padding repeats the order from its start, cyclically when the dataset is smaller than
    // the padding (N < R), exactly as PyTorch's sampler does.
    order.reserve(total);
    for (size_t i = n; i < total; ++i) order.push_back(order[i % n]);
  }
  return order;
}

std::vector<int64_t> DistributedSampler::indices() const {
  const std::vector<int64_t> order = epoch_order();
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (int64_t p = rank_; p < total_size_; p += num_replicas_)
    mine.push_back(order[static_cast<size_t>(p)]);
  return mine;
}

}  // namespace tandem::data
