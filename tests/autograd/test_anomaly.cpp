// Anomaly mode: the first NaN or Inf of forward or backward throws AnomalyError naming the op.
#include <cmath>
#include <limits>
#include <thread>

#include "autograd/anomaly.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "catch.h"
#include "helpers.h"

using namespace tandem;
using autograd::AnomalyError;
using autograd::AnomalyMode;
using autograd::DetectAnomalyGuard;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::values;

namespace {

Tensor leaf_of(const std::vector<double>& v, Device d = kCPU) {
  Tensor t = from_vector(v, {static_cast<int64_t>(v.size())}).to(d);
  t.set_requires_grad();
  return t;
}

// log of a negative number: NaN in the forward of Log.
void check_forward_nan(Device d) {
  Tensor x = leaf_of({2.0, -1.0, 3.0}, d);
  DetectAnomalyGuard anomaly;
  const std::string msg = error_message<AnomalyError>([&] { log(exp(x) - 3.0); });
  INFO(msg);
  CHECK(contains(msg, "forward op Log returned nan in output 0 [3] float64 (element 1)"));
  CHECK(contains(msg, "inputs: [3] float64"));
}

// sqrt at 0: a finite forward whose backward gives inf (d sqrt(x)/dx = 1 / (2 sqrt(x))).
void check_backward_inf(Device d) {
  Tensor x = leaf_of({4.0, 0.0, 1.0}, d);
  DetectAnomalyGuard anomaly;
  Tensor y = sum(sqrt(x) * 2.0);
  const std::string msg = error_message<AnomalyError>([&] { y.backward(); });
  INFO(msg);
  CHECK(contains(msg, "backward node SqrtBackward returned inf in its gradient for input 0 [3] float64 (element 1)"));
  CHECK(contains(msg, "created by forward op Sqrt with inputs: [3] float64"));
}

Tensor add_s(const Tensor& a, double s) { return a + s; }

}  // namespace

TEST_CASE("anomaly mode: forward NaN names the op and its inputs", "[autograd]") {
  check_forward_nan(kCPU);
  SECTION("float32, two inputs") {
    Tensor a = from_vector<float>({1.0f, 0.0f}, {2}).set_requires_grad();
    Tensor b = from_vector<float>({1.0f, 0.0f}, {2});
    DetectAnomalyGuard anomaly;
    const std::string msg = error_message<AnomalyError>([&] { div(a, b); });
    INFO(msg);
    CHECK(contains(msg, "forward op Div returned nan in output 0 [2] float32 (element 1)"));
    CHECK(contains(msg, "inputs: [2] float32, [2] float32"));
  }
  SECTION("-inf is named as such") {
    Tensor x = leaf_of({1.0, 0.0});
    DetectAnomalyGuard anomaly;
    CHECK(contains(error_message<AnomalyError>([&] { log(x); }), "returned -inf in output 0"));
  }
}

TEST_CASE("anomaly mode: backward inf names the backward node and its forward op", "[autograd]") {
  check_backward_inf(kCPU);
  SECTION("a graph recorded with the mode off names only the node") {
    Tensor x = leaf_of({0.0, 1.0});
    Tensor y = sum(sqrt(x));
    DetectAnomalyGuard anomaly;
    const std::string msg = error_message<AnomalyError>([&] { y.backward(); });
    CHECK(contains(msg, "backward node SqrtBackward returned inf"));
    CHECK(contains(msg, "recorded while anomaly mode was off"));
  }
}

TEST_CASE("anomaly mode off: NaN and Inf pass through without a throw", "[autograd]") {
  REQUIRE_FALSE(AnomalyMode::is_enabled());
  Tensor x = leaf_of({2.0, -1.0});
  Tensor nan_out;
  REQUIRE_NOTHROW(nan_out = log(x));
  CHECK(std::isnan(values(nan_out)[1]));
  Tensor z = leaf_of({0.0, 1.0});
  REQUIRE_NOTHROW(sum(sqrt(z)).backward());
  CHECK(std::isinf(values(z.grad())[0]));
  CHECK(values(z.grad())[1] == 0.5);
  // Finite values never throw with the mode on either.
  DetectAnomalyGuard anomaly;
  Tensor w = leaf_of({1.0, 4.0});
  REQUIRE_NOTHROW(sum(sqrt(add_s(w, 1.0))).backward());
  CHECK(w.grad().defined());
}

TEST_CASE("anomaly mode: guards nest, restore, and are per thread", "[autograd]") {
  CHECK_FALSE(AnomalyMode::is_enabled());
  {
    DetectAnomalyGuard outer;
    CHECK(AnomalyMode::is_enabled());
    {
      DetectAnomalyGuard inner;
      CHECK(AnomalyMode::is_enabled());
    }
    CHECK(AnomalyMode::is_enabled());
    bool other_thread = true;
    std::thread([&] { other_thread = AnomalyMode::is_enabled(); }).join();
    CHECK_FALSE(other_thread);
    // Under NoGradGuard nothing is recorded, so nothing is checked (as the header says).
    NoGradGuard no_grad;
    Tensor x = leaf_of({-1.0});
    CHECK_NOTHROW(log(x));
  }
  CHECK_FALSE(AnomalyMode::is_enabled());
  // An error thrown under the guard leaves the mode as it was.
  try {
    DetectAnomalyGuard anomaly;
    log(leaf_of({-1.0}));
  } catch (const AnomalyError&) {
  }
  CHECK_FALSE(AnomalyMode::is_enabled());
}

TEST_CASE("anomaly mode on CUDA tensors", "[autograd][cuda]") {
  TANDEM_REQUIRE_CUDA();
  check_forward_nan(Device::cuda(0));
  check_backward_inf(Device::cuda(0));
}

#ifdef TANDEM_LENET_PATH
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "data/data_test_util.h"
#include "data/idx.h"

namespace {

// Runs lenet with `args` on 64 random 28x28 images written into dir; exit code and output.
std::pair<int, std::string> run_lenet(const tandem::test::TempDir& dir, const std::string& args) {
  for (const char* prefix : {"train", "t10k"}) {
    std::vector<uint8_t> px(64 * 784), labels(64);
    for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 7919) % 251);
    for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<uint8_t>(i % 10);
    data::write_idx_images(dir.file(std::string(prefix) + "-images-idx3-ubyte"), from_vector(px, {64, 28, 28}), false);
    data::write_idx_labels(dir.file(std::string(prefix) + "-labels-idx1-ubyte"), from_vector(labels, {64}), false);
  }
  const std::string out = dir.file("out.txt");
  const std::string cmd = std::string(TANDEM_LENET_PATH) + " --data " + dir.path().string() +
                          " --batch-size 16 --no-progress " + args + " > " + out + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

}  // namespace

TEST_CASE("lenet --detect-anomaly stops at the first NaN or Inf with exit code 1", "[autograd][examples]") {
  tandem::test::TempDir dir;
  // SGD with momentum and lr 1e6 makes the ReLU net's activations overflow float32 within a few
  // steps (a -inf that a later ReLU hides: the loss itself stays finite).
  const std::string diverging = "--device cpu --activation relu --momentum 0.9 --lr 1e6 --epochs 6";
  const auto [code_off, out_off] = run_lenet(dir, diverging);
  INFO(out_off);
  CHECK(code_off == 0);  // without the flag the run goes on
  const auto [code, out] = run_lenet(dir, diverging + " --detect-anomaly");
  INFO(out);
  CHECK(code == 1);
  CHECK(contains(out, "lenet: error: anomaly: "));
  CHECK((contains(out, " returned inf") || contains(out, " returned -inf") || contains(out, " returned nan")));
  // A healthy run is unaffected.
  const auto [code_ok, out_ok] = run_lenet(dir, "--device cpu --epochs 1 --detect-anomaly");
  INFO(out_ok);
  CHECK(code_ok == 0);
  // One thread's guard cannot cover several devices' threads: a bad flag.
  const auto [code_bad, out_bad] = run_lenet(dir, "--epochs 1 --detect-anomaly --devices cpu:0,cpu:1");
  CHECK(code_bad == 2);
  CHECK(contains(out_bad, "--detect-anomaly"));
}
#endif
