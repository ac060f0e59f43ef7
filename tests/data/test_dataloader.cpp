// TensorDataset and DataLoader: coverage, batch counts, seeding, matching pairs, devices.
#include <algorithm>
#include <numeric>
#include <set>

#include "core/error.h"
#include "data/dataloader.h"
#include "data_test_util.h"
#include "helpers.h"

using namespace tandem;
using namespace tandem::data;
using tandem::test::check_throws_containing;

namespace {

// Sample i: image [1, 2, 2] filled with i + {0, .25, .5, .75}, label i.
TensorDataset numbered(int64_t n, Device device = kCPU) {
  std::vector<float> x(static_cast<size_t>(n) * 4);
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < 4; ++k) x[size_t(i) * 4 + size_t(k)] = float(i) + 0.25f * float(k);
    y[size_t(i)] = i;
  }
  return TensorDataset(from_vector<float>(x, {n, 1, 2, 2}, device),
                       from_vector<int64_t>(y, {n}, device));
}

// Labels of one epoch, in order; checks every batch's images match its labels.
std::vector<int64_t> run_epoch(DataLoader& loader, std::vector<int64_t>* batch_sizes = nullptr) {
  std::vector<int64_t> seen;
  for (const auto& [x, y] : loader) {
    REQUIRE(x.dim() == 4);
    REQUIRE(x.size(0) == y.size(0));
    CHECK(x.device() == loader.options().device);
    CHECK(y.device() == loader.options().device);
    std::vector<float> xs = x.to_vector<float>();
    std::vector<int64_t> ys = y.to_vector<int64_t>();
    for (size_t b = 0; b < ys.size(); ++b)
      for (size_t k = 0; k < 4; ++k) CHECK(xs[b * 4 + k] == float(ys[b]) + 0.25f * float(k));
    seen.insert(seen.end(), ys.begin(), ys.end());
    if (batch_sizes) batch_sizes->push_back(y.size(0));
  }
  return seen;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

}  // namespace

TEST_CASE("dataset: get gathers matching rows", "[data]") {
  TensorDataset ds = numbered(6);
  CHECK(ds.size() == 6);
  Batch b = ds.get(from_vector<int64_t>({4, 0, 4}, {3}));
  CHECK(b.x.shape() == Shape{3, 1, 2, 2});
  CHECK(b.y.to_vector<int64_t>() == std::vector<int64_t>{4, 0, 4});
  CHECK(b.x.to_vector<float>()[4] == 0.0f);
  const Batch none = ds.get(from_vector<int64_t>({}, {0}));  // no rows: the shapes, no gather
  CHECK(none.x.shape() == Shape{0, 1, 2, 2});
  CHECK(none.y.shape() == Shape{0});
  CHECK(none.y.dtype() == kInt64);
  check_throws_containing<ShapeError>(
      [] {
        TensorDataset(zeros({3, 2}), zeros({4}, kInt64));
      },
      {"3 images", "4 labels"});
}

TEST_CASE("dataloader: every sample exactly once per epoch, with and without drop_last", "[data]") {
  const int64_t n = 10;
  SECTION("keep the last partial batch") {
    DataLoader loader(numbered(n), {.batch_size = 3, .shuffle = true, .seed = 7});
    CHECK(loader.num_batches() == 4);
    CHECK(loader.size() == n);
    for (int e = 0; e < 3; ++e) {
      std::vector<int64_t> sizes;
      std::vector<int64_t> seen = run_epoch(loader, &sizes);
      CHECK(sizes == std::vector<int64_t>{3, 3, 3, 1});
      std::sort(seen.begin(), seen.end());
      CHECK(seen == iota(n));
    }
    CHECK(loader.epoch() == 3);
  }
  SECTION("drop the last partial batch") {
    DataLoader loader(numbered(n),
                      {.batch_size = 3, .shuffle = true, .drop_last = true, .seed = 7});
    CHECK(loader.num_batches() == 3);
    std::vector<int64_t> sizes;
    std::vector<int64_t> seen = run_epoch(loader, &sizes);
    CHECK(sizes == std::vector<int64_t>{3, 3, 3});
    CHECK(std::set<int64_t>(seen.begin(), seen.end()).size() == 9);
  }
  SECTION("an exact multiple loses nothing to drop_last") {
    DataLoader loader(numbered(n), {.batch_size = 5, .drop_last = true});
    CHECK(loader.num_batches() == 2);
    std::vector<int64_t> seen = run_epoch(loader);
    std::sort(seen.begin(), seen.end());
    CHECK(seen == iota(n));
  }
  SECTION("batch size equal to the dataset") {
    DataLoader loader(numbered(n), {.batch_size = n, .shuffle = false});
    CHECK(loader.num_batches() == 1);
    CHECK(run_epoch(loader) == iota(n));
  }
  SECTION("no shuffle keeps dataset order every epoch") {
    DataLoader loader(numbered(n), {.batch_size = 4, .shuffle = false});
    CHECK(run_epoch(loader) == iota(n));
    CHECK(run_epoch(loader) == iota(n));
  }
}

TEST_CASE("dataloader: seeded shuffle repeats across runs and differs across epochs", "[data]") {
  const int64_t n = 64;
  DataLoader a(numbered(n), {.batch_size = 8, .seed = 1234});
  DataLoader b(numbered(n), {.batch_size = 8, .seed = 1234});
  DataLoader c(numbered(n), {.batch_size = 8, .seed = 1235});
  std::vector<int64_t> a0 = run_epoch(a), a1 = run_epoch(a), a2 = run_epoch(a);
  std::vector<int64_t> b0 = run_epoch(b), b1 = run_epoch(b), b2 = run_epoch(b);
  CHECK(a0 == b0);
  CHECK(a1 == b1);
  CHECK(a2 == b2);
  CHECK(a0 != a1);
  CHECK(a1 != a2);
  CHECK(a0 != iota(n));
  CHECK(run_epoch(c) != a0);
  // set_epoch replays a chosen epoch.
  a.set_epoch(1);
  CHECK(run_epoch(a) == a1);
  CHECK(a.epoch() == 2);
  // The order tensor is the epoch's permutation.
  std::vector<int64_t> order = a.order().to_vector<int64_t>();
  CHECK(order == a1);
}

TEST_CASE("dataloader: invalid batch sizes", "[data]") {
  TensorDataset ds = numbered(5);
  check_throws_containing<ValueError>([&] { (void)DataLoader(ds, {.batch_size = 0}); },
                                      {"batch_size", "0"});
  check_throws_containing<ValueError>([&] { (void)DataLoader(ds, {.batch_size = -3}); }, {"-3"});
  check_throws_containing<ValueError>([&] { (void)DataLoader(ds, {.batch_size = 6}); },
                                      {"6", "5 samples"});
  DataLoader loader(ds, {.batch_size = 2});
  check_throws_containing<ValueError>([&] { loader.batch(0); }, {"begin"});
}

TEST_CASE("dataloader: a CUDA loader yields the CPU loader's batches on the device",
          "[data][cuda]") {
  TANDEM_REQUIRE_CUDA();
  const int64_t n = 37;
  DataLoader cpu(numbered(n), {.batch_size = 8, .seed = 5});
  DataLoader gpu(numbered(n), {.batch_size = 8, .seed = 5, .device = Device::cuda(0)});
  CHECK(gpu.dataset().device() == Device::cuda(0));
  for (int e = 0; e < 2; ++e) {
    auto it = cpu.begin();
    for (const Batch& g : gpu) {
      REQUIRE(it != cpu.end());
      CHECK(g.x.device() == Device::cuda(0));
      CHECK(g.x.to(kCPU).to_vector<float>() == it->x.to_vector<float>());
      CHECK(g.y.to(kCPU).to_vector<int64_t>() == it->y.to_vector<int64_t>());
      ++it;
    }
    CHECK(it == cpu.end());
  }
}

TEST_CASE("dataloader: set_epoch(e, b) resumes mid-epoch with the uninterrupted run's batches", "[data]") {
  const int64_t n = 23;
  for (bool with_sampler : {false, true}) {
    INFO("sampler " << with_sampler);
    auto make = [&](int64_t rank) {
      DataLoaderOptions o{.batch_size = 4, .seed = 11};
      if (with_sampler) o.sampler = std::make_shared<DistributedSampler>(n, 2, rank, true, 11);
      return DataLoader(numbered(n), o);
    };
    for (int64_t rank : {int64_t{0}, int64_t{1}}) {
      if (!with_sampler && rank == 1) continue;
      // The uninterrupted run: epochs 0, 1 and 2, each batch's labels.
      DataLoader whole = make(rank);
      std::vector<std::vector<int64_t>> all;
      for (int64_t e = 0; e < 3; ++e) {
        if (whole.options().sampler) whole.options().sampler->set_epoch(e);
        for (const Batch& b : whole) all.push_back(b.y.to_vector<int64_t>());
      }
      const int64_t per_epoch = whole.num_batches();
      for (int64_t cut : {int64_t{0}, int64_t{1}, int64_t{3}, per_epoch}) {
        INFO("resume at epoch 1, batch " << cut);
        DataLoader resumed = make(rank);  // a new process: nothing carried over but (epoch, batch)
        resumed.set_epoch(1, cut);
        CHECK(resumed.first_batch() == cut);
        std::vector<std::vector<int64_t>> got;
        for (int64_t e = 1; e < 3; ++e) {
          if (resumed.options().sampler) resumed.options().sampler->set_epoch(e);
          for (const Batch& b : resumed) got.push_back(b.y.to_vector<int64_t>());
        }
        const std::vector<std::vector<int64_t>> want(all.begin() + per_epoch + cut, all.end());
        CHECK(got == want);
        CHECK(resumed.first_batch() == 0);  // only the named epoch starts late
      }
    }
  }
  DataLoader loader(numbered(n), {.batch_size = 4});
  check_throws_containing<ValueError>([&] { loader.set_epoch(0, 7); }, {"first_batch 7", "[0, 6]"});
  check_throws_containing<ValueError>([&] { loader.set_epoch(0, -1); }, {"first_batch -1"});
}

TEST_CASE("dataloader: batch_index gives the rows batch() gathers", "[data]") {
  DataLoader loader(numbered(10), {.batch_size = 4, .shuffle = true, .seed = 3});
  std::vector<int64_t> via_iterator;
  for (const Batch& b : loader)
    for (int64_t v : b.y.to_vector<int64_t>()) via_iterator.push_back(v);
  loader.set_epoch(0);
  loader.begin();  // the same epoch again
  std::vector<int64_t> via_index;
  for (int64_t b = 0; b < loader.num_batches(); ++b) {
    const Tensor index = loader.batch_index(b);
    CHECK(index.size(0) == loader.batch_rows(b));
    CHECK(index.to_vector<int64_t>() == loader.batch(b).y.to_vector<int64_t>());  // label i is sample i
    for (int64_t v : index.to_vector<int64_t>()) via_index.push_back(v);
  }
  CHECK(via_index == via_iterator);
  check_throws_containing<ValueError>([&] { loader.batch_index(3); }, {"batch 3 outside [0, 3)"});
}
