// DistributedSampler and the DataLoader with a sampler: shards partition the data, equal batch
// counts, the same global batches as one process, epochs, unpadded evaluation, bad arguments.
#include <algorithm>
#include <map>
#include <set>

#include "core/error.h"
#include "data/dataloader.h"
#include "data/distributed_sampler.h"
#include "data_test_util.h"
#include "helpers.h"

using namespace tandem;
using namespace tandem::data;
using tandem::test::check_throws_containing;

namespace {

// Sample i: image [1, 2] = {i, -i}, label i.
TensorDataset numbered(int64_t n) {
  std::vector<float> x(static_cast<size_t>(n) * 2);
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    x[size_t(i) * 2] = float(i);
    x[size_t(i) * 2 + 1] = -float(i);
    y[size_t(i)] = i;
  }
  return TensorDataset(from_vector<float>(x, {n, 1, 2}), from_vector<int64_t>(y, {n}));
}

// Labels of every batch of one epoch; checks images match labels.
std::vector<std::vector<int64_t>> epoch_batches(DataLoader& loader) {
  std::vector<std::vector<int64_t>> out;
  int64_t b = 0;
  for (const Batch& batch : loader) {
    REQUIRE(batch.x.size(0) == batch.y.size(0));
    CHECK(batch.y.size(0) == loader.batch_rows(b++));
    std::vector<int64_t> ys = batch.y.to_vector<int64_t>();
    std::vector<float> xs = batch.x.to_vector<float>();
    for (size_t i = 0; i < ys.size(); ++i) CHECK(xs[2 * i] == float(ys[i]));
    out.push_back(ys);
  }
  CHECK(b == loader.num_batches());
  return out;
}

std::multiset<int64_t> as_set(const std::vector<int64_t>& v) {
  return {v.begin(), v.end()};
}

}  // namespace

TEST_CASE("sampler: shards partition the dataset, padded or truncated", "[data][dist]") {
  std::vector<int64_t> sizes;
  for (int64_t n = 1; n <= 13; ++n) sizes.push_back(n);
  sizes.push_back(100);
  for (int64_t n : sizes)
    for (int64_t world = 1; world <= 4; ++world)
      for (bool drop_last : {false, true})
        for (bool shuffle : {false, true}) {
          INFO("n " << n << " world " << world << " drop_last " << drop_last << " shuffle "
                    << shuffle);
          std::vector<int64_t> all;
          for (int64_t r = 0; r < world; ++r) {
            DistributedSampler s(n, world, r, shuffle, 5, drop_last);
            const std::vector<int64_t> mine = s.indices();
            CHECK(int64_t(mine.size()) == s.num_samples());
            CHECK(s.total_size() == s.num_samples() * world);
            CHECK(s.num_samples() == (drop_last ? n / world : (n + world - 1) / world));
            all.insert(all.end(), mine.begin(), mine.end());
          }
          std::map<int64_t, int> count;
          for (int64_t i : all) {
            REQUIRE((i >= 0 && i < n));
            ++count[i];
          }
          if (drop_last) {
            // No duplicates, and only the last n mod world samples of the order are missing.
            CHECK(int64_t(count.size()) == n / world * world);
            for (const auto& [i, c] : count) CHECK(c == 1);
          } else {
            // Every index; the padding repeats the order from its start, cyclically.
            CHECK(int64_t(count.size()) == n);
            const int64_t total = int64_t(all.size());
            for (const auto& [i, c] : count) {
              CHECK(c >= total / n);
              CHECK(c <= (total + n - 1) / n);
            }
            DistributedSampler s0(n, world, 0, shuffle, 5, drop_last);
            const std::vector<int64_t> order = s0.epoch_order();
            for (int64_t p = n; p < total; ++p) CHECK(order[size_t(p)] == order[size_t(p % n)]);
          }
        }
}

TEST_CASE("sampler: shuffled order is the DataLoader's, and set_epoch changes and replays it",
          "[data][dist]") {
  const int64_t n = 37;
  DistributedSampler s(n, 1, 0, true, 99);
  DataLoader plain(numbered(n), {.batch_size = n, .shuffle = true, .seed = 99});
  for (int64_t e = 0; e < 3; ++e) {
    s.set_epoch(e);
    CHECK(s.epoch() == e);
    CHECK(s.indices() == epoch_permutation(n, 99, e));
    plain.begin();
    CHECK(plain.order().to_vector<int64_t>() == s.indices());
  }
  s.set_epoch(0);
  const std::vector<int64_t> e0 = s.indices();
  s.set_epoch(1);
  CHECK(s.indices() != e0);
  s.set_epoch(0);
  CHECK(s.indices() == e0);
  // Another seed, another order; no shuffle, the identity.
  CHECK(DistributedSampler(n, 1, 0, true, 100).indices() != e0);
  std::vector<int64_t> id(n);
  for (int64_t i = 0; i < n; ++i) id[size_t(i)] = i;
  CHECK(DistributedSampler(n, 1, 0, false).indices() == id);
}

TEST_CASE("sampler: world size 1 loader yields exactly the plain loader's batches",
          "[data][dist]") {
  const int64_t n = 23;
  for (bool drop_last : {false, true})
    for (bool shuffle : {false, true}) {
      INFO("drop_last " << drop_last << " shuffle " << shuffle);
      auto sampler = std::make_shared<DistributedSampler>(n, 1, 0, shuffle, 7);
      DataLoader plain(numbered(n),
                       {.batch_size = 5, .shuffle = shuffle, .drop_last = drop_last, .seed = 7});
      DataLoader dist(numbered(n), {.batch_size = 5, .drop_last = drop_last, .sampler = sampler});
      CHECK(dist.num_batches() == plain.num_batches());
      for (int64_t e = 0; e < 2; ++e) {
        sampler->set_epoch(e);
        CHECK(epoch_batches(dist) == epoch_batches(plain));
      }
    }
}

TEST_CASE("sampler: the ranks' batch k together is the one-process batch k", "[data][dist]") {
  for (int64_t world : {2, 3}) {
    for (int64_t batch : {6, 7, 12}) {
      const int64_t n = 36;  // divisible by both worlds: no padding
      INFO("world " << world << " batch " << batch);
      DataLoader plain(numbered(n), {.batch_size = batch, .seed = 3});
      plain.set_epoch(2);
      const auto one = epoch_batches(plain);
      std::vector<std::vector<std::vector<int64_t>>> ranks;
      for (int64_t r = 0; r < world; ++r) {
        auto sampler = std::make_shared<DistributedSampler>(n, world, r, true, 3);
        sampler->set_epoch(2);
        DataLoader loader(numbered(n), {.batch_size = batch, .sampler = sampler});
        CHECK(loader.num_batches() == plain.num_batches());
        for (int64_t b = 0; b < loader.num_batches(); ++b)
          CHECK(loader.global_batch_rows(b) == plain.batch_rows(b));
        ranks.push_back(epoch_batches(loader));
      }
      for (size_t k = 0; k < one.size(); ++k) {
        std::vector<int64_t> joined;
        size_t smallest = SIZE_MAX, largest = 0;
        for (const auto& r : ranks) {
          joined.insert(joined.end(), r[k].begin(), r[k].end());
          smallest = std::min(smallest, r[k].size());
          largest = std::max(largest, r[k].size());
        }
        CHECK(as_set(joined) == as_set(one[k]));
        CHECK(largest - smallest <= 1);
      }
    }
  }
}

TEST_CASE("sampler: every rank has the same number of batches", "[data][dist]") {
  for (int64_t n : {7, 10, 13, 100})
    for (int64_t world = 1; world <= 4; ++world)
      for (int64_t batch : {world, world + 1, 2 * world + 1})
        for (bool sampler_drop : {false, true})
          for (bool loader_drop : {false, true}) {
            if (batch > n) continue;
            INFO("n " << n << " world " << world << " batch " << batch << " sampler drop_last "
                      << sampler_drop << " loader drop_last " << loader_drop);
            std::set<int64_t> counts;
            std::vector<int64_t> rows_per_batch;
            for (int64_t r = 0; r < world; ++r) {
              auto sampler =
                  std::make_shared<DistributedSampler>(n, world, r, true, 1, sampler_drop);
              DataLoader loader(
                  numbered(n), {.batch_size = batch, .drop_last = loader_drop, .sampler = sampler});
              counts.insert(loader.num_batches());
              const int64_t total = sampler->total_size();
              CHECK(loader.num_batches() ==
                    (loader_drop ? total / batch : (total + batch - 1) / batch));
              const auto batches = epoch_batches(loader);
              rows_per_batch.resize(batches.size());
              for (size_t k = 0; k < batches.size(); ++k)
                rows_per_batch[k] += int64_t(batches[k].size());
              // Rank r's batches are consecutive runs of its indices().
              std::vector<int64_t> flat;
              for (const auto& b : batches) flat.insert(flat.end(), b.begin(), b.end());
              std::vector<int64_t> mine = sampler->indices();
              mine.resize(flat.size());
              CHECK(flat == mine);
            }
            CHECK(counts.size() == 1);
            // Global batch rows are the sum of the shards.
            auto sampler = std::make_shared<DistributedSampler>(n, world, 0, true, 1, sampler_drop);
            DataLoader loader(numbered(n),
                              {.batch_size = batch, .drop_last = loader_drop, .sampler = sampler});
            for (size_t k = 0; k < rows_per_batch.size(); ++k)
              CHECK(loader.global_batch_rows(int64_t(k)) == rows_per_batch[k]);
          }
}

TEST_CASE("sampler: without padding every sample counts exactly once", "[data][dist]") {
  for (int64_t n : {1, 2, 5, 10, 13, 100})
    for (int64_t world = 1; world <= 4; ++world) {
      INFO("n " << n << " world " << world);
      std::vector<int64_t> all, loaded;
      std::set<int64_t> sizes;
      for (int64_t r = 0; r < world; ++r) {
        DistributedSampler s(n, world, r, true, 11, false, /*pad=*/false);
        CHECK(s.total_size() == n);
        const std::vector<int64_t> mine = s.indices();
        CHECK(int64_t(mine.size()) == s.num_samples());
        sizes.insert(s.num_samples());
        all.insert(all.end(), mine.begin(), mine.end());
        if (n >= world) {
          for (int64_t batch : {world, 3 * world}) {
            if (batch > n) continue;
            auto sampler =
                std::make_shared<DistributedSampler>(n, world, r, true, 11, false, false);
            DataLoader loader(numbered(n), {.batch_size = batch, .sampler = sampler});
            const int64_t global = (n + batch - 1) / batch;
            CHECK(loader.num_batches() >= global - 1);
            CHECK(loader.num_batches() <= global);
            if (batch == world)
              for (const auto& b : epoch_batches(loader)) {
                CHECK(!b.empty());
                loaded.insert(loaded.end(), b.begin(), b.end());
              }
          }
        }
      }
      std::sort(all.begin(), all.end());
      std::vector<int64_t> id(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) id[size_t(i)] = i;
      CHECK(all == id);
      CHECK(*sizes.rbegin() - *sizes.begin() <= 1);
      if (n >= world) {
        std::sort(loaded.begin(), loaded.end());
        CHECK(loaded == id);
      }
    }
}

TEST_CASE("sampler: a padded last batch can give a rank an empty shard", "[data][dist]") {
  // n 6, world 3, global batch 4: batch 1 holds positions 4, 5 -> ranks 1 and 2 only.
  auto sampler = std::make_shared<DistributedSampler>(6, 3, 0, false);
  DataLoader loader(numbered(6), {.batch_size = 4, .sampler = sampler});
  CHECK(loader.num_batches() == 2);
  CHECK(loader.batch_rows(0) == 2);
  CHECK(loader.batch_rows(1) == 0);
  CHECK(loader.global_batch_rows(1) == 2);
  const auto batches = epoch_batches(loader);
  CHECK(batches[0] == std::vector<int64_t>{0, 3});
  CHECK(batches[1].empty());
  loader.begin();
  const Batch empty = loader.batch(1);
  CHECK(empty.x.shape() == Shape{0, 1, 2});
  CHECK(empty.y.shape() == Shape{0});
}

TEST_CASE("sampler: bad arguments name the value", "[data][dist]") {
  check_throws_containing<ValueError>([] { DistributedSampler(10, 2, 2); },
                                      {"DistributedSampler: rank 2 is not below num_replicas 2"});
  check_throws_containing<ValueError>([] { DistributedSampler(10, 2, -1); }, {"rank", "-1"});
  check_throws_containing<ValueError>([] { DistributedSampler(10, 0, 0); }, {"num_replicas", "0"});
  check_throws_containing<ValueError>([] { DistributedSampler(-3, 1, 0); }, {"dataset_size", "-3"});
  check_throws_containing<ValueError>([] { DistributedSampler(10, 1, 0).set_epoch(-1); },
                                      {"set_epoch", "-1"});
  auto sampler = std::make_shared<DistributedSampler>(9, 2, 0);
  check_throws_containing<ValueError>(
      [&] { DataLoader(numbered(10), {.batch_size = 4, .sampler = sampler}); },
      {"sampler is for 9 samples", "10"});
  auto four = std::make_shared<DistributedSampler>(10, 4, 1);
  check_throws_containing<ValueError>(
      [&] { DataLoader(numbered(10), {.batch_size = 3, .sampler = four}); },
      {"batch_size 3", "num_replicas 4"});
}
