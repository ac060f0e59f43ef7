// Trace::scoped: a span of the trace when there is one, a span that records nothing when not.
#include "core/error.h"
#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;
using tandem::test::contains;

TEST_CASE("Trace::scoped records with a trace and nothing without", "[parallel]") {
  Trace trace(std::vector<Device>{kCPU});
  { auto span = Trace::scoped(&trace, kCPU, "traced step", "comm"); }
  REQUIRE(trace.size() == 1);
  { auto span = Trace::scoped(nullptr, kCPU, "untraced step"); }
  REQUIRE(trace.size() == 1);
  const std::string json = trace.json();
  CHECK(contains(json, "traced step"));
  CHECK(contains(json, "comm"));
  CHECK_FALSE(contains(json, "untraced"));
  REQUIRE_THROWS_AS(Trace::scoped(&trace, Device::cpu(5), "elsewhere"), DeviceError);
}
