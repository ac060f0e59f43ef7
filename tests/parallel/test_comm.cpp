// Communicators: naive and ring on virtual CPU devices (and NCCL on GPUs) against the closed
// form and against a host-side sum of random data, at tiny, odd and large sizes.
#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::values;

namespace {

const int64_t kSizes[] = {1, 7, 1000, 1 << 20};

// Device i filled with i + 1: afterwards every device holds n(n+1)/2 everywhere.
void check_closed_form(Communicator& comm, int64_t numel) {
  const size_t n = comm.size();
  std::vector<Tensor> ts;
  for (size_t i = 0; i < n; ++i) ts.push_back(full({numel}, double(i + 1), kFloat32, comm.devices()[i]));
  comm.allreduce_sum(ts);
  const double expect = double(n * (n + 1) / 2);
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> v = values(ts[i]);
    bool all = true;
    for (double x : v) all = all && x == expect;
    INFO(comm.name() << " device " << i << " numel " << numel);
    CHECK(all);
  }
}

// Random data of `shape`; compares with the sum computed on the host in float64.
void check_random(Communicator& comm, const Shape& shape, DType dtype, Generator& gen) {
  const size_t n = comm.size();
  std::vector<Tensor> ts;
  std::vector<double> expect(size_t(shape_numel(shape)), 0.0);
  for (size_t i = 0; i < n; ++i) {
    Tensor t = randn(shape, dtype, kCPU, &gen);
    std::vector<double> v = values(t);
    for (size_t j = 0; j < v.size(); ++j) expect[j] += v[j];
    ts.push_back(t.to(comm.devices()[i]));
  }
  comm.allreduce_sum(ts);
  const double tol = dtype == kFloat64 ? 1e-12 : 1e-5;
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> v = values(ts[i]);
    double worst = 0;
    for (size_t j = 0; j < v.size(); ++j) worst = std::max(worst, std::abs(v[j] - expect[j]));
    INFO(comm.name() << " device " << i << " shape " << shape_str(shape));
    CHECK(worst <= tol * (1 + double(n)));
    CHECK(values(ts[i]) == values(ts[0]));  // every device gets the very same bytes
  }
}

void check_broadcast(Communicator& comm, Generator& gen) {
  const size_t n = comm.size();
  for (size_t root = 0; root < n; ++root) {
    for (int64_t numel : {int64_t(1), int64_t(7), int64_t(1000)}) {
      std::vector<Tensor> ts;
      for (size_t i = 0; i < n; ++i) ts.push_back(randn({numel}, kFloat32, comm.devices()[i], &gen));
      const std::vector<double> want = values(ts[root]);
      comm.broadcast(ts, root);
      for (size_t i = 0; i < n; ++i) {
        INFO(comm.name() << " root " << root << " device " << i << " numel " << numel);
        CHECK(values(ts[i]) == want);
      }
    }
  }
}

// reduce_sum onto every root in turn: device i filled with i + 1, the root gets n(n+1)/2.
void check_reduce(Communicator& comm) {
  const size_t n = comm.size();
  for (size_t root = 0; root < n; ++root) {
    for (int64_t numel : {int64_t(1), int64_t(1001)}) {
      std::vector<Tensor> ts;
      for (size_t i = 0; i < n; ++i) ts.push_back(full({numel}, double(i + 1), kFloat32, comm.devices()[i]));
      comm.reduce_sum(ts, root);
      INFO(comm.name() << " root " << root << " numel " << numel);
      for (double x : values(ts[root])) CHECK(x == double(n * (n + 1) / 2));
    }
  }
  std::vector<Tensor> ts;
  for (size_t i = 0; i < n; ++i) ts.push_back(zeros({3}, kFloat32, comm.devices()[i]));
  CHECK(contains(error_message<ValueError>([&] { comm.reduce_sum(ts, n); }), "root"));
}

}  // namespace

TEST_CASE("reduce_sum onto any root on virtual CPU devices", "[parallel]") {
  for (size_t n : {size_t(1), size_t(2), size_t(3)}) {
    std::vector<Device> devices;
    for (size_t i = 0; i < n; ++i) devices.push_back(Device::cpu(int(i)));
    for (const std::string& name : {"naive", "ring"}) {
      auto comm = make_communicator(name, devices);
      check_reduce(*comm);
    }
  }
}

TEST_CASE("allreduce_sum and broadcast on virtual CPU devices", "[parallel]") {
  Generator gen(7);
  for (const char* name : {"naive", "ring"}) {
    for (int n : {1, 2, 3, 4}) {
      DYNAMIC_SECTION(name << " on " << n << " devices") {
        auto comm = make_communicator(name, cpu_devices(n));
        CHECK(comm->name() == name);
        for (int64_t numel : kSizes) check_closed_form(*comm, numel);
        check_random(*comm, {7}, kFloat32, gen);
        check_random(*comm, {10, 100}, kFloat64, gen);
        check_random(*comm, {3, 0}, kFloat32, gen);
        // A non-contiguous input is reduced through a contiguous copy and written back.
        std::vector<Tensor> ts;
        for (int i = 0; i < n; ++i) ts.push_back(full({4, 3}, double(i + 1), kFloat32, comm->devices()[size_t(i)]).transpose(0, 1));
        comm->allreduce_sum(ts);
        for (const Tensor& t : ts) CHECK(values(t) == std::vector<double>(12, double(n * (n + 1) / 2)));
        check_broadcast(*comm, gen);
      }
    }
  }
}

TEST_CASE("ring and naive agree bit for bit on int64", "[parallel]") {
  auto devices = cpu_devices(3);
  auto ring = make_communicator("ring", devices);
  auto naive = make_communicator("naive", devices);
  std::vector<Tensor> a, b;
  for (int i = 0; i < 3; ++i) {
    Tensor t = arange(i * 1000, i * 1000 + 1001, 1, kInt64, devices[size_t(i)]);
    a.push_back(t.clone());
    b.push_back(t.clone());
  }
  ring->allreduce_sum(a);
  naive->allreduce_sum(b);
  for (int i = 0; i < 3; ++i) CHECK(a[size_t(i)].to_vector<int64_t>() == b[size_t(i)].to_vector<int64_t>());
}

TEST_CASE("communicators reject bad arguments by name", "[parallel]") {
  auto devices = cpu_devices(2);
  CHECK(contains(error_message<ValueError>([&] { make_communicator("tree", devices); }), "'tree'"));
  std::string nccl = error_message<Error>([&] { make_communicator("nccl", devices); });
  CHECK(contains(nccl, "naive"));
  CHECK(contains(nccl, "ring"));
  CHECK_THROWS_AS(make_communicator("ring", {}), ValueError);
  for (const char* name : {"naive", "ring"}) {
    auto comm = make_communicator(name, devices);
    std::string msg = error_message<ValueError>([&] { comm->allreduce_sum({zeros({3}, kFloat32, devices[0])}); });
    CHECK(contains(msg, "1 tensors for 2 devices"));
    msg = error_message<ShapeError>([&] {
      comm->allreduce_sum({zeros({3}, kFloat32, devices[0]), zeros({4}, kFloat32, devices[1])});
    });
    CHECK(contains(msg, "[4]"));
    CHECK(contains(msg, "[3]"));
    msg = error_message<DTypeError>([&] {
      comm->allreduce_sum({zeros({3}, kFloat32, devices[0]), zeros({3}, kFloat64, devices[1])});
    });
    CHECK(contains(msg, "float64"));
    msg = error_message<DeviceError>([&] {
      comm->allreduce_sum({zeros({3}, kFloat32, devices[0]), zeros({3}, kFloat32, devices[0])});
    });
    CHECK(contains(msg, "cpu:1"));
    CHECK_THROWS_AS(comm->broadcast({zeros({3}, kFloat32, devices[0]), zeros({3}, kFloat32, devices[1])}, 2),
                    ValueError);
  }
}

TEST_CASE("allreduce_sum and broadcast on two GPUs", "[parallel][cuda]") {
  TANDEM_REQUIRE_CUDA();
  if (!tandem::test::have_two_gpus()) return;
  Generator gen(9);
  const auto devices = cuda_devices(2);
  enable_peer_access(devices);
  for (const std::string& name : communicator_names(devices)) {
    DYNAMIC_SECTION(name) {
      auto comm = make_communicator(name, devices);
      for (int64_t numel : kSizes) check_closed_form(*comm, numel);
      check_random(*comm, {7}, kFloat32, gen);
      check_random(*comm, {1 << 20}, kFloat32, gen);
      check_random(*comm, {1000}, kFloat64, gen);
      check_broadcast(*comm, gen);
      check_reduce(*comm);
    }
  }
  CHECK(communicator_names(devices).size() == (nccl_available() ? 3u : 2u));
}
