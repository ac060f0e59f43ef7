// The one-input-channel convolution kernels (Note [one-input-channel convolution] in
// kernels/cuda/conv_one_channel.cuh) against the CPU reference: the forward with and without a
// bias, the weight and bias gradients, in bfloat16, float32 and float64, with channels-last and
// NCHW outputs; 3x3, 5x5, 7x7, non-square and 1x1 filters, padding 0 to 3, strides 1 and 2, and
// channel counts that fill a block's channel groups, leave some empty or need several blocks.
// Every case is first asserted to be one the kernels take (so a wrong kernel cannot hide behind
// cuDNN); layers they do not take still give the right answer; with one_channel_conv() off the
// results are cuDNN's; float32 gradients of bfloat16 inputs are written straight into the
// tensors given; and a CUDA graph replays the kernels bit for bit.
//
// Tolerances: float32 and float64 as the other CUDA-vs-CPU tests (4x test::tol). A bfloat16
// result is compared with the float32 computation on the same (bfloat16) values: rounded once,
// it is within half a bfloat16 ulp of it, 2^-8 of the largest value; 2^-7 leaves room for the
// other order of the float32 sums. cuDNN's bfloat16 path rounds the sum and then adds the bias
// in bfloat16: 2^-6, as in test_bf16_nn.cpp.
#include <string>
#include <vector>

#include "catch.h"
#include "core/cuda_graph.h"
#include "core/device.h"
#include "helpers.h"
#include "kernels/bf16_test_util.h"
#include "kernels/cuda_test_util.h"
#include "kernels/ops.h"
#ifdef TANDEM_WITH_CUDA
#include "kernels/cuda/conv_one_channel.h"
#endif

using namespace tandem;
using namespace tandem::test;

namespace {

constexpr MemoryFormat kNCHW = MemoryFormat::Contiguous;
constexpr MemoryFormat kCL = MemoryFormat::ChannelsLast;
constexpr double kBf16Once = 1.0 / 128;   // 2^-7: one rounding, in either order of the sums
constexpr double kBf16Cudnn = 1.0 / 64;   // 2^-6: cuDNN's two roundings

struct Case {
  Shape x, w;
  Conv2dParams p;
};

// Layers of one input channel that the kernels take in every dtype and format.
const Case kTaken[] = {
    {{3, 1, 9, 11}, {16, 1, 3, 3}, {1, 1, 1, 1}},    // 3x3: two channel groups
    {{3, 1, 28, 28}, {64, 1, 3, 3}, {1, 1, 1, 1}},   // ResNet-18's stem on Fashion-MNIST
    {{3, 1, 9, 11}, {16, 1, 3, 3}, {1, 1, 0, 0}},    // no padding
    {{3, 1, 9, 11}, {16, 1, 5, 5}, {1, 1, 2, 2}},    // 5x5
    {{3, 1, 28, 28}, {64, 1, 5, 5}, {1, 1, 0, 0}},   // 5x5 on 28x28, no padding
    {{2, 1, 10, 9}, {16, 1, 3, 5}, {1, 1, 1, 2}},    // non-square: the 5x5 kernel's guards
    {{3, 1, 11, 9}, {8, 1, 7, 7}, {1, 1, 3, 3}},     // 7x7
    {{2, 1, 9, 9}, {16, 1, 1, 1}, {1, 1, 0, 0}},     // 1x1
    {{3, 1, 12, 12}, {16, 1, 3, 3}, {2, 2, 1, 1}},   // stride 2
    {{3, 1, 13, 10}, {16, 1, 3, 3}, {2, 1, 0, 2}},   // stride 2 in h only, padding in w only
    {{2, 1, 6, 7}, {16, 1, 3, 3}, {1, 1, 3, 2}},     // padding past the filter: outputs of zeros alone
    {{3, 1, 9, 11}, {48, 1, 3, 3}, {1, 1, 1, 1}},    // six channel groups: empty groups in a block
    {{2, 1, 9, 11}, {128, 1, 3, 3}, {1, 1, 1, 1}},   // sixteen groups: two blocks across them (NCHW)
    {{2, 1, 7, 9}, {256, 1, 3, 3}, {1, 1, 1, 1}},    // 32 groups: a whole warp of them channels-last
    {{37, 1, 28, 28}, {64, 1, 3, 3}, {1, 1, 1, 1}},  // many images: blocks of a few rounds, the last short
};

// Layers they leave to cuDNN (or to the direct kernels).
const Case kNotTaken[] = {
    {{3, 2, 9, 11}, {16, 2, 3, 3}, {1, 1, 1, 1}},   // two input channels
    {{3, 1, 13, 13}, {16, 1, 3, 3}, {3, 3, 1, 1}},  // stride 3
    {{3, 1, 9, 11}, {6, 1, 3, 3}, {1, 1, 1, 1}},    // 6 channels: no multiple of the 8 (float64: 4) a thread computes
    {{2, 1, 12, 12}, {16, 1, 9, 9}, {1, 1, 4, 4}},  // 9x9
};

Shape out_shape(const Case& c) {
  return {c.x[0], c.w[0], (c.x[2] + 2 * c.p.pad_h - c.w[2]) / c.p.stride_h + 1,
          (c.x[3] + 2 * c.p.pad_w - c.w[3]) / c.p.stride_w + 1};
}

std::string describe(DType dt, const Case& c, MemoryFormat fmt) {
  return std::string(dtype_name(dt)) + (fmt == kCL ? " channels-last" : " NCHW") + " x " + shape_str(c.x) + " w " +
         shape_str(c.w) + " stride " + std::to_string(c.p.stride_h) + "," + std::to_string(c.p.stride_w) + " pad " +
         std::to_string(c.p.pad_h) + "," + std::to_string(c.p.pad_w);
}

// Fresh values in [-1, 1) of dtype dt (bfloat16: drawn in float32 and rounded).
Tensor random(const Shape& shape, DType dt) {
  return uniform(shape, -1.0, 1.0, dt == kBFloat16 ? kFloat32 : dt).to(dt);
}

// t on the GPU with exactly the strides of fmt (a [N, 1, H, W] input too: then the convolution
// runs channels-last).
Tensor on_gpu(const Tensor& t, MemoryFormat fmt) { return restrided(t.to(kGpu), fmt); }

// Whether the kernels take the pass with the tensors the dispatcher hands the backend
// (kernels/ops_conv.cpp: the inputs in the convolution's format, outputs made in it).
bool takes_forward(const Tensor& x, const Tensor& w, const Shape& ys, const Conv2dParams& p, MemoryFormat fmt) {
#ifdef TANDEM_WITH_CUDA
  return gpu::one_channel_conv_applies(gpu::OneChannelPass::Forward, x.contiguous(fmt), w.contiguous(fmt),
                                       Tensor(ys, x.dtype(), x.device(), fmt), p);
#else
  return false;
#endif
}
bool takes_wgrad(const Tensor& x, const Tensor& dy, const Tensor& dw, const Conv2dParams& p, MemoryFormat fmt) {
#ifdef TANDEM_WITH_CUDA
  return gpu::one_channel_conv_applies(gpu::OneChannelPass::BackwardWeight, x.contiguous(fmt), dw, dy.contiguous(fmt),
                                       p);
#else
  return false;
#endif
}

struct Restore {
  bool direct = direct_conv(), one = one_channel_conv();
  ~Restore() {
    set_direct_conv(direct);
    set_one_channel_conv(one);
  }
};

// Forward (with and without the bias), weight and bias gradients of case c on the GPU against
// the CPU, computed on the same values in float32 for bfloat16.
void check_case(DType dt, const Case& c, MemoryFormat fmt, bool taken) {
  INFO(describe(dt, c, fmt));
  const Shape ys = out_shape(c);
  const Tensor x = random(c.x, dt), w = random(c.w, dt), b = random({c.w[0]}, dt), dy = random(ys, dt);
  const Tensor xg = on_gpu(x, fmt), wg = on_gpu(w, fmt), bg = b.to(kGpu), dyg = on_gpu(dy, fmt);
  REQUIRE(takes_forward(xg, wg, ys, c.p, fmt) == taken);
  REQUIRE(takes_wgrad(xg, dyg, Tensor(c.w, dt, kGpu, fmt), c.p, fmt) == taken);
  const DType ref = dt == kBFloat16 ? kFloat32 : dt;
  const Tensor xr = x.to(ref), wr = w.to(ref), br = b.to(ref), dyr = dy.to(ref);
  const double tol = dt == kBFloat16 ? (taken ? kBf16Once : kBf16Cudnn) : 4 * test::tol(dt);

  const Tensor y = kernels::conv2d(xg, wg, bg, c.p);
  REQUIRE(y.dtype() == dt);
  REQUIRE(y.shape() == ys);
  if (fmt == kCL) CHECK(y.is_contiguous(kCL));
  CHECK(rel_error(y, kernels::conv2d(xr, wr, br, c.p)) <= tol);
  CHECK(rel_error(kernels::conv2d(xg, wg, Tensor(), c.p), kernels::conv2d(xr, wr, Tensor(), c.p)) <= tol);

  auto [dw_ref, db_ref] = kernels::conv2d_backward_weight(xr, dyr, c.p, c.w, true);
  auto [dw, db] = kernels::conv2d_backward_weight(xg, dyg, c.p, c.w, true);
  REQUIRE(dw.dtype() == dt);
  REQUIRE(db.dtype() == dt);
  CHECK(rel_error(dw, dw_ref) <= tol);
  CHECK(rel_error(db, db_ref) <= tol);
  // Without the bias gradient: the same sums, and the same bits on a second call.
  auto [dw2, none] = kernels::conv2d_backward_weight(xg, dyg, c.p, c.w, false);
  CHECK_FALSE(none.defined());
  CHECK(values(dw2) == values(dw));
}

}  // namespace

TEST_CASE("cuda one-input-channel convolution kernels match the CPU", "[cuda][one_channel]") {
  TANDEM_REQUIRE_CUDA();
  const Restore restore;
  set_one_channel_conv(true);
  set_direct_conv(false);  // packed NCHW float32 and float64 layers would be the direct kernels'
  for (DType dt : {kBFloat16, kFloat32, kFloat64}) {
    for (MemoryFormat fmt : {kCL, kNCHW}) {
      for (const Case& c : kTaken) check_case(dt, c, fmt, true);
    }
  }
}

TEST_CASE("cuda convolutions the one-input-channel kernels do not take still match the CPU", "[cuda][one_channel]") {
  TANDEM_REQUIRE_CUDA();
  const Restore restore;
  set_one_channel_conv(true);
  for (DType dt : {kBFloat16, kFloat32, kFloat64}) {
    for (MemoryFormat fmt : {kCL, kNCHW}) {
      for (const Case& c : kNotTaken) check_case(dt, c, fmt, false);
    }
  }
  // Switched off, no layer is theirs.
  set_one_channel_conv(false);
  set_direct_conv(false);
  for (DType dt : {kBFloat16, kFloat32}) {
    for (MemoryFormat fmt : {kCL, kNCHW}) check_case(dt, kTaken[1], fmt, false);
  }
}

TEST_CASE("cuda one-input-channel kernels on and off give the same results within tolerance", "[cuda][one_channel]") {
  TANDEM_REQUIRE_CUDA();
  const Restore restore;
  set_direct_conv(false);
  for (DType dt : {kBFloat16, kFloat32}) {
    for (MemoryFormat fmt : {kCL, kNCHW}) {
      for (const Case& c : {kTaken[1], kTaken[3], kTaken[8]}) {
        INFO(describe(dt, c, fmt));
        const Shape ys = out_shape(c);
        const Tensor x = on_gpu(random(c.x, dt), fmt), w = on_gpu(random(c.w, dt), fmt);
        const Tensor b = random({c.w[0]}, dt).to(kGpu), dy = on_gpu(random(ys, dt), fmt);
        const double tol = dt == kBFloat16 ? kBf16Cudnn : 4 * test::tol(dt);
        set_one_channel_conv(true);
        REQUIRE(takes_forward(x, w, ys, c.p, fmt));
        const Tensor y_own = kernels::conv2d(x, w, b, c.p);
        auto [dw_own, db_own] = kernels::conv2d_backward_weight(x, dy, c.p, c.w, true);
        set_one_channel_conv(false);
        REQUIRE_FALSE(takes_forward(x, w, ys, c.p, fmt));
        const Tensor y_cudnn = kernels::conv2d(x, w, b, c.p);
        auto [dw_cudnn, db_cudnn] = kernels::conv2d_backward_weight(x, dy, c.p, c.w, true);
        CHECK(rel_error(y_own, y_cudnn) <= tol);
        CHECK(rel_error(dw_own, dw_cudnn) <= tol);
        CHECK(rel_error(db_own, db_cudnn) <= tol);
      }
    }
  }
}

TEST_CASE("conv2d_backward_weight writes float32 gradients of bfloat16 inputs into the tensors given",
          "[kernels][bf16][one_channel]") {
  const Restore restore;
  set_one_channel_conv(true);
  const Conv2dParams p{1, 1, 1, 1};
  const Shape ws{16, 1, 3, 3};
  const Tensor x = rnd_bf16({3, 1, 9, 11}), dy = rnd_bf16({3, 16, 9, 11});
  auto [dw32, db32] = kernels::conv2d_backward_weight(f32(x), f32(dy), p, ws, true);
  {
    INFO("cpu");
    const Tensor dw_into = zeros(ws, kFloat32), db_into = zeros({16}, kFloat32);
    auto [gw, gb] = kernels::conv2d_backward_weight(x, dy, p, ws, true, dw_into, db_into);
    CHECK(gw.same(dw_into));
    CHECK(gb.same(db_into));
    CHECK(values(gw) == values(dw32));  // the float32 sums, rounded no further
    CHECK(values(gb) == values(db32));
    // One of the two given: the other is bfloat16 as without it, and db's float32 tensor holds
    // what a bfloat16 dw's pass computes, widened.
    auto [gw1, gb1] = kernels::conv2d_backward_weight(x, dy, p, ws, true, zeros(ws, kFloat32));
    CHECK(gb1.dtype() == kBFloat16);
    CHECK(values(gb1) == values(bf16(db32)));
    const Tensor db_only = zeros({16}, kFloat32);
    auto [gw2, gb2] = kernels::conv2d_backward_weight(x, dy, p, ws, true, Tensor(), db_only);
    CHECK(gw2.dtype() == kBFloat16);
    CHECK(values(gw2) == values(bf16(dw32)));
    CHECK(gb2.same(db_only));
    CHECK(values(gb2) == values(bf16(db32)));
    // Only float32 for bfloat16: another dtype is refused by name.
    const Tensor x64 = f32(x).to(kFloat64), dy64 = f32(dy).to(kFloat64);
    CHECK(contains(
        error_message<DTypeError>([&] { kernels::conv2d_backward_weight(x, dy, p, ws, false, zeros(ws, kFloat64)); }),
        "dw"));
    CHECK(contains(
        error_message<DTypeError>([&] { kernels::conv2d_backward_weight(x64, dy64, p, ws, false, zeros(ws)); }),
        "dw"));
  }
  if (!have_cuda()) {
    WARN("no GPU on this machine: CUDA part skipped");
    return;
  }
  for (MemoryFormat fmt : {kCL, kNCHW}) {
    INFO((fmt == kCL ? "cuda channels-last" : "cuda NCHW"));
    const Tensor xg = on_gpu(x, fmt), dyg = on_gpu(dy, fmt);
    const Tensor dw_into = zeros(ws, kFloat32, kGpu), db_into = zeros({16}, kFloat32, kGpu);
    REQUIRE(takes_wgrad(xg, dyg, dw_into, p, fmt));
    auto [gw, gb] = kernels::conv2d_backward_weight(xg, dyg, p, ws, true, dw_into, db_into);
    CHECK(gw.same(dw_into));
    CHECK(gb.same(db_into));
    // float32 sums of the bfloat16 products: far closer than a bfloat16 rounding (2^-9).
    CHECK(rel_error(gw, dw32) <= 4 * test::tol(kFloat32));
    CHECK(rel_error(gb, db32) <= 4 * test::tol(kFloat32));
    // A layer the kernels do not take: computed in bfloat16, then converted -- into dw_into
    // where the layouts allow (NCHW), else a bfloat16 dw returned for the caller to convert.
    const Shape ws2{16, 2, 3, 3};
    const Tensor x2 = rnd_bf16({3, 2, 9, 11}), x2g = on_gpu(x2, fmt);
    const Tensor dw2_into = zeros(ws2, kFloat32, kGpu), db2_into = zeros({16}, kFloat32, kGpu);
    REQUIRE_FALSE(takes_wgrad(x2g, dyg, dw2_into, p, fmt));
    auto [dw2_ref, db2_ref] = kernels::conv2d_backward_weight(f32(x2), f32(dy), p, ws2, true);
    auto [gw2, gb2] = kernels::conv2d_backward_weight(x2g, dyg, p, ws2, true, dw2_into, db2_into);
    CHECK(gw2.same(dw2_into) == (fmt == kNCHW));
    CHECK(gb2.same(db2_into));
    CHECK(rel_error(gw2, dw2_ref) <= kBf16Cudnn);
    CHECK(rel_error(gb2, db2_ref) <= kBf16Cudnn);
  }
  // One input channel, float32, channels-last: the two layouts of dw are the same memory, so
  // the gradient is written into the NCHW tensor given.
  const Tensor x32 = on_gpu(f32(x), kCL), dy32 = on_gpu(f32(dy), kCL), dw_into = zeros(ws, kFloat32, kGpu);
  auto [gw, none] = kernels::conv2d_backward_weight(x32, dy32, p, ws, false, dw_into);
  CHECK(gw.same(dw_into));
  CHECK(rel_error(gw, dw32) <= 4 * test::tol(kFloat32));
}

TEST_CASE("cuda one-input-channel kernels replayed from a CUDA graph give the eager bits",
          "[cuda][one_channel][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Restore restore;
  set_one_channel_conv(true);
  const Conv2dParams p{1, 1, 1, 1};
  const Shape xs{8, 1, 28, 28}, ws{64, 1, 3, 3}, ys{8, 64, 28, 28};
  const Tensor x = on_gpu(rnd_bf16(xs), kCL), w = on_gpu(rnd_bf16(ws), kCL), dy = on_gpu(rnd_bf16(ys), kCL);
  REQUIRE(takes_forward(x, w, ys, p, kCL));
  const Tensor y_out = empty(ys, kBFloat16, kGpu, kCL), dw_out = zeros(ws, kFloat32, kGpu);
  REQUIRE(takes_wgrad(x, dy, dw_out, p, kCL));
  CUDAGraph g;
  g.capture_begin(kGpu);
  {
    const Tensor y = kernels::conv2d(x, w, Tensor(), p);  // made and released inside the capture
    y_out.copy_(y);
    kernels::conv2d_backward_weight(x, dy, p, ws, false, dw_out);
  }
  g.capture_end();
  REQUIRE(g.captured());
  for (int replay = 0; replay < 2; ++replay) {
    INFO("replay " << replay);
    x.copy_(on_gpu(rnd_bf16(xs), kCL));
    dy.copy_(on_gpu(rnd_bf16(ys), kCL));
    g.replay();
    CHECK(values(y_out) == values(kernels::conv2d(x, w, Tensor(), p)));
    const Tensor dw_eager = zeros(ws, kFloat32, kGpu);
    kernels::conv2d_backward_weight(x, dy, p, ws, false, dw_eager);
    CHECK(values(dw_out) == values(dw_eager));
  }
}
