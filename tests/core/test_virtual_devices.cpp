// Virtual CUDA devices (Note [virtual CUDA devices] in core/device.h): the `cuda:P*K` spelling,
// the table of logical to physical GPUs, and what refuses it. None of this needs a GPU.
#include <cstdio>

#include "catch.h"
#include "core/device.h"
#include "core/error.h"
#include "helpers.h"
#include "parallel/comm.h"
#include "parallel/device_api.h"

using namespace tandem;
using tandem::test::contains;
using tandem::test::error_message;

namespace {

// Restores the table the test found, however the test ends.
struct RestoreTable {
  std::vector<int> saved = virtual_cuda_devices();
  ~RestoreTable() {
    try {
      set_virtual_cuda_devices(saved);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "could not restore the virtual CUDA devices: %s\n", e.what());
    }
  }
};

std::vector<Device> cuda(std::initializer_list<int> indices) {
  std::vector<Device> out;
  for (int i : indices) out.push_back(Device::cuda(i));
  return out;
}

}  // namespace

TEST_CASE("parse_device_list_spec: cuda:P*K is K logical devices on GPU P", "[core][virtual_gpu]") {
  auto spec = parse_device_list_spec("cuda:0*2");
  CHECK(spec.devices == cuda({0, 1}));
  CHECK(spec.table == std::vector<int>{0, 0});
  // Several GPUs, in list order; a plain entry in such a list is one device on that GPU.
  spec = parse_device_list_spec("cuda:0*2, cuda:1*2");
  CHECK(spec.devices == cuda({0, 1, 2, 3}));
  CHECK(spec.table == std::vector<int>{0, 0, 1, 1});
  spec = parse_device_list_spec("cuda:1*2,cuda:0");
  CHECK(spec.devices == cuda({0, 1, 2}));
  CHECK(spec.table == std::vector<int>{1, 1, 0});
  spec = parse_device_list_spec("cuda:1*1");
  CHECK(spec.devices == cuda({0}));
  CHECK(spec.table == std::vector<int>{1});
  // A plain list asks for no table: it names logical devices of the table in force.
  spec = parse_device_list_spec("cuda:1,cuda:0");
  CHECK(spec.devices == cuda({1, 0}));
  CHECK(spec.table.empty());
}

TEST_CASE("the table maps logical CUDA devices to GPUs", "[core][virtual_gpu]") {
  RestoreTable restore;
  // cuda:40 .. cuda:43: indices no other test uses (a device once used keeps its GPU).
  std::vector<int> table(44, 0);
  table[42] = table[43] = 1;
  set_virtual_cuda_devices(table);
  CHECK(virtual_cuda_devices() == table);
  CHECK(physical_cuda_index(Device::cuda(41)) == 0);
  CHECK(physical_cuda_index(Device::cuda(42)) == 1);
  CHECK(same_physical_device(Device::cuda(40), Device::cuda(41)));
  CHECK_FALSE(same_physical_device(Device::cuda(41), Device::cuda(42)));
  CHECK_FALSE(same_physical_device(Device::cuda(40), kCPU));
  CHECK(parallel::shares_a_gpu(cuda({40, 41})));
  CHECK(parallel::shares_a_gpu(cuda({40, 42, 43})));
  CHECK_FALSE(parallel::shares_a_gpu(cuda({41, 42})));
  // A device outside the table does not exist.
  const std::string msg = error_message<DeviceError>([] { physical_cuda_index(Device::cuda(44)); });
  CHECK(contains(msg, "cuda:44"));
  CHECK(contains(msg, "cuda:0 to cuda:43"));
  CHECK(contains(error_message<DeviceError>([] { physical_cuda_index(kCPU); }), "cpu:0"));
  // The empty table is the identity.
  set_virtual_cuda_devices({});
  CHECK(virtual_cuda_devices().empty());
  CHECK(physical_cuda_index(Device::cuda(5)) == 5);
  CHECK_FALSE(same_physical_device(Device::cuda(0), Device::cuda(1)));
}

TEST_CASE("parse_device_list installs the table of a cuda:P*K list", "[core][virtual_gpu]") {
  RestoreTable restore;
  try {
    CHECK(parse_device_list("cuda:0*2") == cuda({0, 1}));
    CHECK(virtual_cuda_devices() == std::vector<int>{0, 0});
    CHECK(physical_cuda_index(Device::cuda(1)) == 0);
  } catch (const DeviceError& e) {
    // Refused only where cuda:1 is a real GPU some earlier test of this process has used.
    REQUIRE(physical_cuda_device_count() >= 2);
    CHECK(contains(e.what(), "cuda:1 already runs on GPU 1"));
  }
}

TEST_CASE("parse_device_list: bad counts and duplicates name the text", "[core][virtual_gpu]") {
  RestoreTable restore;
  const std::vector<int> before = virtual_cuda_devices();
  struct Bad {
    const char* text;
    const char* says;
  };
  for (const Bad& bad : {Bad{"cuda:0*0", "at least 1"}, Bad{"cuda:0*x", "must be a number"},
                         Bad{"cuda:0*", "must be a number"}, Bad{"cuda:0*-1", "must be a number"},
                         Bad{"cuda:0*2,cuda:0", "cuda:0 appears twice"},
                         Bad{"cuda:0,cuda:0*2", "cuda:0 appears twice"},
                         Bad{"cuda:1*2,cuda:1*3", "cuda:1 appears twice"},
                         Bad{"cpu:0*2", "only a GPU"}, Bad{"cuda:0*2,cpu:1", "cannot be mixed"},
                         Bad{"cuda:0*40,cuda:1*40", "at most 64"}}) {
    INFO(bad.text);
    const std::string msg = error_message<ValueError>([&] { parse_device_list(bad.text); });
    CHECK(contains(msg, std::string("'") + bad.text + "'"));
    CHECK(contains(msg, bad.says));
    CHECK(virtual_cuda_devices() == before);  // a list that fails installs nothing
  }
  // A plain duplicate stays an error, and says how to ask for sharing.
  const std::string msg = error_message<ValueError>([] { parse_device_list("cuda:0,cuda:0"); });
  CHECK(contains(msg, "'cuda:0,cuda:0'"));
  CHECK(contains(msg, "twice"));
  CHECK(contains(msg, "cuda:0*2"));
  CHECK(contains(error_message<ValueError>([] { set_virtual_cuda_devices({0, -1}); }), "GPU -1"));
}

TEST_CASE("virtual CUDA devices: a device in use does not move to another GPU", "[core][virtual_gpu]") {
  RestoreTable restore;
  // cuda:39: an index no other test uses, since the binding lasts for the process (and the
  // machine has fewer GPUs, so that without a table cuda:39 does not exist).
  std::vector<int> table(40, 0);
  set_virtual_cuda_devices(table);
  try {
    DeviceGuard use(Device::cuda(39));  // binds cuda:39 to GPU 0 (cudaSetDevice(0) with CUDA)
  } catch (const CudaError&) {
    // A CUDA build on a machine without a GPU cannot make a CUDA device current.
    REQUIRE_FALSE(cuda_available());
    WARN("CUDA build without a GPU: the binding of a device in use is not checked");
    return;
  }
  table[39] = 1;
  const std::string msg = error_message<DeviceError>([&] { set_virtual_cuda_devices(table); });
  CHECK(contains(msg, "cuda:39 already runs on GPU 0 and cannot move to GPU 1"));
  CHECK(contains(msg, "before any CUDA work"));
  CHECK(physical_cuda_index(Device::cuda(39)) == 0);  // the refused table left no trace
  // Adding unused devices and dropping devices are fine; so is putting cuda:39 back on GPU 0.
  table[39] = 0;
  table.push_back(1);
  set_virtual_cuda_devices(table);
  set_virtual_cuda_devices({0});
  set_virtual_cuda_devices({});
  set_virtual_cuda_devices(std::vector<int>(40, 0));
  CHECK(virtual_cuda_devices().size() == 40);
}

TEST_CASE("cuda_device_count counts logical devices only where there are GPUs", "[core][virtual_gpu]") {
  RestoreTable restore;
  const int gpus = physical_cuda_device_count();
  set_virtual_cuda_devices({0, 0, 0});
  CHECK(physical_cuda_device_count() == gpus);
  CHECK(cuda_device_count() == (gpus == 0 ? 0 : 3));
  CHECK(cuda_available() == (gpus > 0));
  if (gpus == 0) {
    const std::string msg = error_message<DeviceError>([] { check_device_exists(Device::cuda(1)); });
    CHECK(contains(msg, "cuda:1"));
  } else {
    check_device_exists(Device::cuda(2));
    CHECK(contains(error_message<DeviceError>([] { check_device_exists(Device::cuda(3)); }), "cuda:0 to cuda:2"));
  }
}

TEST_CASE("the nccl communicator refuses devices that share a GPU", "[parallel][virtual_gpu]") {
  RestoreTable restore;
  std::vector<int> table(44, 0);
  set_virtual_cuda_devices(table);
  const auto devices = cuda({40, 41});
  const std::string msg =
      error_message<DeviceError>([&] { parallel::make_communicator("nccl", devices); });
  CHECK(contains(msg, "cuda:40 and cuda:41"));
  CHECK(contains(msg, "same GPU 0"));
  CHECK(contains(msg, "NCCL refuses two ranks on one GPU"));
  CHECK(contains(msg, "--comm ring"));
  CHECK(contains(msg, "naive"));
  // Nor is it offered for them.
  for (const std::string& name : parallel::communicator_names(devices)) CHECK(name != "nccl");
}
