// Stream and Event: CPU semantics (null handles, synchronous work, host timestamps) and the CUDA
// ones (a per-device non-blocking default stream, thread-local current streams, events ordering
// one stream after another without a host sync). CUDA cases skip themselves without a GPU.
#include <chrono>
#include <thread>

#include "catch.h"
#include "core/error.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "helpers.h"

using namespace tandem;
using tandem::test::contains;
using tandem::test::error_message;

TEST_CASE("CPU streams have a null handle and are always done", "[core]") {
  for (Device d : {kCPU, Device::cpu(3)}) {
    INFO(d.str());
    Stream s = current_stream(d);
    CHECK(s.device() == d);
    CHECK(s.handle() == nullptr);
    CHECK(s == Stream::default_stream(d));
    CHECK(s.query());
    s.synchronize();  // a no-op, must not throw
    Stream created = Stream::create(d, /*high_priority=*/true);
    CHECK(created.device() == d);
    CHECK(created.handle() == nullptr);
    {
      StreamGuard guard(created);  // nothing to switch on CPU
      CHECK(current_stream(d) == s);
    }
  }
  CHECK(Stream(kCPU, nullptr) != Stream(Device::cpu(1), nullptr));
  CHECK(contains(error_message<DeviceError>([] { Stream::default_stream(Device::cpu(64)); }), "cpu:64"));
}

TEST_CASE("CPU events record host time on the stream's device", "[core]") {
  Event start(true), end(true);
  CHECK_FALSE(start.recorded());
  CHECK(start.query());  // never recorded: nothing to wait for
  start.wait(current_stream(kCPU));  // a no-op
  start.record(current_stream(Device::cpu(2)));
  CHECK(start.recorded());
  CHECK(start.device() == Device::cpu(2));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  end.record(current_stream(Device::cpu(2)));
  CHECK(end.query());
  end.synchronize();
  const float ms = start.elapsed_ms(end);
  CHECK(ms >= 15.0f);
  CHECK(ms < 10000.0f);
  CHECK(end.elapsed_ms(start) < 0.0f);  // the other way round

  // Moving an event keeps what it recorded; the moved-from one is unrecorded.
  Event moved(std::move(start));
  CHECK(moved.recorded());
  CHECK_FALSE(start.recorded());  // NOLINT(bugprone-use-after-move): part of the contract
  CHECK(moved.elapsed_ms(end) == Approx(ms));

  Event never;
  CHECK(contains(error_message<ValueError>([&] { never.elapsed_ms(end); }), "both events must be recorded"));
  Event other;
  other.record(current_stream(kCPU));
  CHECK(contains(error_message<DeviceError>([&] { other.elapsed_ms(end); }), "events on cpu:0 and cpu:2"));
}

TEST_CASE("CUDA default streams are per device, non-blocking, and not stream 0", "[core][cuda]") {
  TANDEM_REQUIRE_CUDA();
  const Device d = Device::cuda(0);
  Stream s = current_stream(d);
  CHECK(s.device() == d);
  CHECK(s.handle() != nullptr);  // never the legacy stream
  CHECK(s == Stream::default_stream(d));
  CHECK(s == current_stream(d));  // the same stream every time
  Stream other = Stream::create(d);
  CHECK(other.handle() != nullptr);
  CHECK(other != s);
  CHECK(Stream::create(d, true) != other);
  CHECK_THROWS_AS(Stream::default_stream(Device::cuda(cuda_device_count())), DeviceError);
}

TEST_CASE("CUDA current streams are thread-local and restored by StreamGuard", "[core][cuda]") {
  TANDEM_REQUIRE_CUDA();
  const Device d = Device::cuda(0);
  const Stream def = current_stream(d);
  const Stream side = Stream::create(d);
  {
    StreamGuard guard(side);
    CHECK(current_stream(d) == side);
    Stream seen_elsewhere;
    std::thread([&] { seen_elsewhere = current_stream(d); }).join();
    CHECK(seen_elsewhere == def);  // another thread keeps the default
    {
      StreamGuard inner(def);
      CHECK(current_stream(d) == def);
    }
    CHECK(current_stream(d) == side);
  }
  CHECK(current_stream(d) == def);
}

TEST_CASE("a CUDA event orders one stream after another without a host sync", "[core][cuda]") {
  TANDEM_REQUIRE_CUDA();
  const Device d = Device::cuda(0);
  const Stream producer = Stream::create(d), consumer = Stream::create(d);
  const int64_t n = 1 << 22;  // enough work that an unordered copy would see stale data
  Tensor src = zeros({n}, kFloat32, d);
  Tensor dst = zeros({n}, kFloat32, d);
  producer.synchronize();
  current_stream(d).synchronize();
  Event start(true), done(true);
  {
    StreamGuard g(producer);
    start.record(producer);
    for (int i = 1; i <= 8; ++i) src.fill_(static_cast<double>(i));
    done.record(producer);
  }
  done.wait(consumer);
  {
    StreamGuard g(consumer);
    dst.copy_(src);
  }
  consumer.synchronize();
  CHECK(done.query());
  CHECK(producer.query());
  const std::vector<float> got = dst.to(kCPU).to_vector<float>();
  CHECK(got.front() == 8.0f);
  CHECK(got.back() == 8.0f);
  CHECK(start.elapsed_ms(done) >= 0.0f);

  Event untimed;
  untimed.record(producer);
  CHECK(contains(error_message<ValueError>([&] { untimed.elapsed_ms(done); }), "enable_timing"));
  Event on_cpu;
  on_cpu.record(current_stream(kCPU));
  CHECK(contains(error_message<DeviceError>([&] { on_cpu.elapsed_ms(done); }), "events on cpu:0 and cuda:0"));
}

#ifdef TANDEM_WITH_CUDA
#include <cuda_runtime.h>

TEST_CASE("CUDA stream priorities: background below the default streams, high above them", "[core][cuda]") {
  TANDEM_REQUIRE_CUDA();
  const Device d = Device::cuda(0);
  const auto priority = [](const Stream& s) {
    int p = 0;
    REQUIRE(cudaStreamGetPriority(static_cast<cudaStream_t>(s.handle()), &p) == cudaSuccess);
    return p;
  };
  int lowest = 0, greatest = 0;
  REQUIRE(cudaDeviceGetStreamPriorityRange(&lowest, &greatest) == cudaSuccess);
  const int normal = priority(Stream::default_stream(d));
  CHECK(priority(Stream::create(d)) == normal);
  CHECK(priority(Stream::create(d, false)) == normal);
  CHECK(priority(Stream::create(d, StreamPriority::Background)) == lowest);
  CHECK(priority(Stream::create(d, true)) == greatest);
  if (greatest < lowest - 1) {  // lower numbers run first: background below normal below high
    CHECK(lowest > normal);
    CHECK(normal > greatest);
  }
}
#endif
