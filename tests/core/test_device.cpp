// Device names: parsing, device lists, and the range of virtual CPU devices.
#include "catch.h"
#include "core/device.h"
#include "core/error.h"
#include "helpers.h"

using namespace tandem;
using tandem::test::contains;
using tandem::test::error_message;

TEST_CASE("Device::parse reads cpu, cpu:N, cuda and cuda:N", "[core]") {
  CHECK(Device::parse("cpu") == kCPU);
  CHECK(Device::parse("cpu:3") == Device::cpu(3));
  CHECK(Device::parse("cuda") == Device::cuda(0));
  CHECK(Device::parse("cuda:1") == Device::cuda(1));
  CHECK(Device::parse("cpu:1").str() == "cpu:1");
  for (const char* bad : {"tpu", "cpu:", "cpu:-1", "cpu:x", "cuda:1234567"}) {
    INFO(bad);
    CHECK(contains(error_message<ValueError>([&] { Device::parse(bad); }), bad));
  }
}

TEST_CASE("virtual CPU devices are cpu:0 to cpu:63", "[core]") {
  CHECK(Device::parse("cpu:63") == Device::cpu(63));
  check_device_exists(Device::cpu(63));
  for (const char* bad : {"cpu:64", "cpu:99999"}) {
    INFO(bad);
    const std::string msg = error_message<ValueError>([&] { Device::parse(bad); });
    CHECK(contains(msg, std::string("'") + bad + "'"));
    CHECK(contains(msg, "cpu:0 to cpu:63"));
  }
  CHECK(contains(error_message<ValueError>([] { parse_device_list("cpu:0,cpu:99999"); }), "cpu:99999"));
  // A device built in code, not parsed, is checked where it is used.
  const std::string msg = error_message<DeviceError>([] { check_device_exists(Device::cpu(99999)); });
  CHECK(contains(msg, "cpu:99999"));
  CHECK(contains(msg, "cpu:0 to cpu:63"));
}

TEST_CASE("parse_device_list rejects empty entries, duplicates and mixed kinds", "[core]") {
  CHECK(parse_device_list("cpu:0, cpu:1") == std::vector<Device>{Device::cpu(0), Device::cpu(1)});
  CHECK(contains(error_message<ValueError>([] { parse_device_list("cpu:0,,cpu:1"); }), "empty entry"));
  CHECK(contains(error_message<ValueError>([] { parse_device_list("cpu:1,cpu:1"); }), "twice"));
  CHECK(contains(error_message<ValueError>([] { parse_device_list("cpu:0,cuda:0"); }), "mixed"));
}
