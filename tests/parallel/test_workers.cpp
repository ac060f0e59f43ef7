// DeviceWorkers: persistent threads, one per device, with device, stream and grad mode of the
// caller; exceptions come back to the caller with the device named.
#include <atomic>
#include <set>
#include <thread>
#include <typeinfo>

#include "autograd/grad_mode.h"
#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;
using tandem::test::contains;
using tandem::test::error_message;

TEST_CASE("workers run on their own device and thread, the same threads every time", "[parallel]") {
  DeviceWorkers workers(cpu_devices(3));
  REQUIRE(workers.size() == 3);
  std::vector<std::thread::id> first(3), second(3);
  std::vector<Device> seen(3);
  workers.run([&](size_t r) {
    first[r] = std::this_thread::get_id();
    seen[r] = current_device();
  });
  workers.run([&](size_t r) { second[r] = std::this_thread::get_id(); });
  CHECK(first == second);
  CHECK(std::set<std::thread::id>(first.begin(), first.end()).size() == 3);
  CHECK(first[0] != std::this_thread::get_id());
  CHECK(seen == cpu_devices(3));
  CHECK_FALSE(workers.in_worker());
}

TEST_CASE("workers run at the same time", "[parallel]") {
  DeviceWorkers workers(cpu_devices(3));
  std::atomic<int> arrived{0};
  // Each worker waits until all have arrived: only possible when they run concurrently.
  workers.run([&](size_t) {
    ++arrived;
    while (arrived.load() < 3) std::this_thread::yield();
  });
  CHECK(arrived.load() == 3);
}

TEST_CASE("workers take the caller's grad mode", "[parallel]") {
  DeviceWorkers workers(cpu_devices(2));
  std::vector<int> mode(2, -1);
  workers.run([&](size_t r) { mode[r] = grad_enabled(); });
  CHECK(mode == std::vector<int>{1, 1});
  {
    NoGradGuard no_grad;
    workers.run([&](size_t r) { mode[r] = grad_enabled(); });
  }
  CHECK(mode == std::vector<int>{0, 0});
  workers.run([&](size_t r) { mode[r] = grad_enabled(); });
  CHECK(mode == std::vector<int>{1, 1});
}

TEST_CASE("an exception in a worker reaches the caller with the device named", "[parallel]") {
  DeviceWorkers workers(cpu_devices(3));
  std::string msg = error_message<ShapeError>([&] {
    workers.run([](size_t r) {
      if (r == 1) TANDEM_THROW(Shape, "bad shape on rank ", r);
    });
  });
  CHECK(contains(msg, "worker 1 (cpu:1)"));
  CHECK(contains(msg, "bad shape on rank 1"));

  // Several failures: the first by rank, and how many failed.
  msg = error_message<Error>([&] {
    workers.run([](size_t r) {
      if (r > 0) throw std::runtime_error("boom " + std::to_string(r));
    });
  });
  CHECK(contains(msg, "worker 1 (cpu:1) and 1 more of 3 failed"));
  CHECK(contains(msg, "boom 1"));

  // The pool still works afterwards.
  std::atomic<int> ran{0};
  workers.run([&](size_t) { ++ran; });
  CHECK(ran.load() == 3);
}

TEST_CASE("every tandem error type keeps its type through a worker", "[parallel]") {
  DeviceWorkers workers(cpu_devices(2));
  // Every type of the one list in core/error.h: a type added there without its own
  // rethrow_with_prefix (a plain `: public Error`) comes back as its parent and fails here.
  const std::vector<test::ErrorCase> cases = test::error_cases();
  REQUIRE(cases.size() == static_cast<size_t>(detail::kNumErrorKinds));
  for (const test::ErrorCase& c : cases) {
    INFO(c.name);
    try {
      workers.run([&](size_t r) {
        if (r == 1) detail::throw_error(c.kind, std::string("failing with ") + c.name, __FILE__, __LINE__);
      });
      FAIL("expected an exception");
    } catch (const Error& e) {
      CHECK(typeid(e) == c.type);
      CHECK(contains(e.what(), "worker 1 (cpu:1) failed: failing with " + std::string(c.name)));
    }
  }
}

TEST_CASE("a nested run is refused instead of deadlocking", "[parallel]") {
  DeviceWorkers workers(cpu_devices(2));
  std::string msg = error_message<Error>([&] {
    workers.run([&](size_t) { workers.run([](size_t) {}); });
  });
  CHECK(contains(msg, "nested"));
}

TEST_CASE("parallel_apply runs each replica's forward on its device", "[parallel]") {
  Generator gen(5);
  auto devices = cpu_devices(2);
  DeviceWorkers workers(devices);
  auto replicas = replicate(tandem::test::small_mlp(gen), devices);
  auto [x, y] = tandem::test::random_batch(6, {8}, 4, gen);
  auto outs = parallel_apply(workers, replicas, scatter(x, devices));
  REQUIRE(outs.size() == 2);
  CHECK(outs[1].device() == devices[1]);
  CHECK(tandem::test::rel_error(gather(outs, devices[0]), replicas[0]->forward(x)) < 1e-6);
  CHECK_THROWS_AS(parallel_apply(workers, replicas, {x}), ValueError);
}
