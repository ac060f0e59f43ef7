// split_sizes, scatter and gather: shapes, values, devices and gradients.
#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::values;

TEST_CASE("split_sizes cuts as evenly as possible, larger shards first", "[parallel]") {
  CHECK(split_sizes(255, 2) == std::vector<int64_t>{128, 127});
  CHECK(split_sizes(12, 3) == std::vector<int64_t>{4, 4, 4});
  CHECK(split_sizes(13, 3) == std::vector<int64_t>{5, 4, 4});
  CHECK(split_sizes(3, 3) == std::vector<int64_t>{1, 1, 1});
  CHECK(split_sizes(7, 1) == std::vector<int64_t>{7});
  std::string msg = error_message<ValueError>([] { split_sizes(2, 3); });
  CHECK(contains(msg, "batch of 2"));
  CHECK(contains(msg, "3 devices"));
  CHECK_THROWS_AS(split_sizes(4, 0), ValueError);
}

TEST_CASE("scatter and gather round-trip with gradients", "[parallel]") {
  Generator gen(3);
  for (int64_t batch : {12, 13}) {
    for (size_t n : {1, 2, 3}) {
      DYNAMIC_SECTION("batch " << batch << " on " << n << " devices") {
        const auto devices = cpu_devices(int(n));
        Tensor x = randn({batch, 5}, kFloat32, kCPU, &gen).set_requires_grad(true);
        std::vector<Tensor> shards = scatter(x, devices);
        REQUIRE(shards.size() == n);
        const auto sizes = split_sizes(batch, n);
        int64_t start = 0;
        for (size_t i = 0; i < n; ++i) {
          CHECK(shards[i].device() == devices[i]);
          CHECK(shards[i].shape() == Shape{sizes[i], 5});
          CHECK(values(shards[i]) == values(x.slice(0, start, start + sizes[i])));
          start += sizes[i];
        }
        // Weight each shard differently so the gradient shows which rows went where.
        std::vector<Tensor> outs;
        for (size_t i = 0; i < n; ++i) outs.push_back(mul(shards[i], double(i + 1)));
        Tensor y = gather(outs, Device::cpu(0));
        CHECK(y.device() == Device::cpu(0));
        CHECK(y.shape() == x.shape());
        sum(y).backward();
        std::vector<double> g = values(x.grad());
        start = 0;
        for (size_t i = 0; i < n; ++i) {
          for (int64_t j = start * 5; j < (start + sizes[i]) * 5; ++j) {
            CHECK(g[size_t(j)] == double(i + 1));
          }
          start += sizes[i];
        }
      }
    }
  }
}

TEST_CASE("scatter rejects a batch smaller than the device count", "[parallel]") {
  Tensor x = zeros({2, 3});
  std::string msg = error_message<ValueError>([&] { scatter(x, cpu_devices(3)); });
  CHECK(contains(msg, "batch of 2"));
  CHECK(contains(msg, "3 devices"));
  CHECK_THROWS_AS(scatter(x, std::vector<int64_t>{1, 2}, cpu_devices(2)), ShapeError);
}

TEST_CASE("device lists are validated with the list in the message", "[parallel]") {
  CHECK(contains(error_message<ValueError>([] { DeviceWorkers w({}); }), "empty device list"));
  CHECK(contains(error_message<ValueError>([] { DeviceWorkers w({Device::cpu(0), Device::cpu(0)}); }),
            "cpu:0 twice"));
  CHECK(contains(error_message<ValueError>([] { check_device_list({Device::cpu(0), Device::cuda(0)}, "x"); }),
            "mixes CPU and CUDA"));
  std::string msg = error_message<DeviceError>([] {
    check_device_list({Device::cuda(cuda_device_count())}, "x");
  });
  CHECK(contains(msg, "cuda:" + std::to_string(cuda_device_count())));
  CHECK(cuda_or_cpu_devices(2).size() == 2);
}
