// cuDNN's memsets in a captured graph (Note [cuDNN's memsets in a captured graph] in
// kernels/cuda/graph_memset.cu): memset nodes rewritten as kernel nodes that write the same
// bytes in the same order; a call captured apart and joined to a capture whose graph allocates
// (where no node may be removed); and convolutions replayed from graphs, the same bits with the
// rewrite on and off. A workspace prepared ahead (Note [a workspace prepared ahead]): the
// preparation of a stream's own workspace split off, after the workspace's last use, and
// convolutions replayed on new inputs with it on and off.
#include <algorithm>
#include <cstring>
#include <vector>

#include "catch.h"
#include "core/cuda_graph.h"
#include "core/cuda_stream.h"
#include "helpers.h"
#include "kernels/backend.h"
#include "kernels/bf16_test_util.h"
#include "kernels/ops.h"
#include "nn/nn_test_util.h"
#ifdef TANDEM_WITH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/graph_memset.h"
#endif

using namespace tandem;

#ifdef TANDEM_WITH_CUDA
namespace {

// One memset and what it writes, byte by byte.
struct MemsetCase {
  size_t offset, element_size, width, height, pitch;
  unsigned value;
};

// 16-byte words (a 2-byte element), 4-byte words over three pitched rows, single bytes at an
// odd address, 8-byte words, and a last memset over part of the second one's bytes, which must
// run after it (the order kept).
const std::vector<MemsetCase> kCases = {{0, 2, 64, 1, 0, 0xBEEF},
                                        {192, 4, 5, 3, 32, 0x01020304u},
                                        {301, 1, 37, 1, 0, 0xAB},
                                        {344, 1, 40, 1, 0, 0x7F},
                                        {200, 4, 2, 2, 32, 0xFFFFFFFFu}};

std::vector<unsigned char> expected_bytes() {
  std::vector<unsigned char> want(1024, 0);
  for (const MemsetCase& c : kCases) {
    for (size_t r = 0; r < c.height; ++r) {
      for (size_t b = 0; b < c.width * c.element_size; ++b) {
        want[c.offset + r * c.pitch + b] = static_cast<unsigned char>(c.value >> (8 * (b % c.element_size)));
      }
    }
  }
  return want;
}

cudaMemsetParams params_of(const MemsetCase& c, char* base) {
  cudaMemsetParams m{};
  m.dst = base + c.offset;
  m.value = c.value;
  m.elementSize = static_cast<unsigned>(c.element_size);
  m.width = c.width;
  m.height = c.height;
  m.pitch = c.pitch;
  return m;
}

// How many nodes of each kind `graph` holds (at its top level).
struct NodeCounts {
  size_t all = 0, memset = 0, kernel = 0, child = 0, alloc = 0;
};
NodeCounts count_nodes(cudaGraph_t graph) {
  size_t n = 0;
  REQUIRE(cudaGraphGetNodes(graph, nullptr, &n) == cudaSuccess);
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0) REQUIRE(cudaGraphGetNodes(graph, nodes.data(), &n) == cudaSuccess);
  NodeCounts c;
  c.all = n;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    REQUIRE(cudaGraphNodeGetType(node, &type) == cudaSuccess);
    c.memset += type == cudaGraphNodeTypeMemset;
    c.kernel += type == cudaGraphNodeTypeKernel;
    c.child += type == cudaGraphNodeTypeGraph;
    c.alloc += type == cudaGraphNodeTypeMemAlloc;
  }
  return c;
}

// The only child graph node's graph.
cudaGraph_t child_graph(cudaGraph_t graph) {
  size_t n = 0;
  REQUIRE(cudaGraphGetNodes(graph, nullptr, &n) == cudaSuccess);
  std::vector<cudaGraphNode_t> nodes(n);
  REQUIRE(cudaGraphGetNodes(graph, nodes.data(), &n) == cudaSuccess);
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    REQUIRE(cudaGraphNodeGetType(node, &type) == cudaSuccess);
    if (type != cudaGraphNodeTypeGraph) continue;
    cudaGraph_t child = nullptr;
    REQUIRE(cudaGraphChildGraphNodeGetGraph(node, &child) == cudaSuccess);
    return child;
  }
  FAIL("no child graph node");
  return nullptr;
}

std::vector<unsigned char> read_back(const void* p) {
  std::vector<unsigned char> out(1024);
  REQUIRE(cudaMemcpy(out.data(), p, out.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  return out;
}

void launch_and_wait(cudaGraph_t graph, cudaStream_t stream) {
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
}

// The byte-wide cases' memsets, captured apart through run_memsets_as_kernels, inside a
// capture that allocates and frees 1 KB of its own (an allocation node: no node of that graph
// can be removed), copies `out` (1 KB, zeroed first) there, and the result back to `out`. Returns the bytes of `out` after one launch; `replaced` and the graph's node counts
// say what happened.
std::vector<unsigned char> capture_apart(bool on, size_t* replaced, NodeCounts* top, NodeCounts* inner) {
  const test::SettingRestore restore(set_cudnn_memsets_as_kernels, cudnn_memsets_as_kernels);
  set_cudnn_memsets_as_kernels(on);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  char* out = nullptr;
  REQUIRE(cudaMalloc(&out, 1024) == cudaSuccess);
  REQUIRE(cudaMemset(out, 0, 1024) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  char* scratch = nullptr;
  REQUIRE(cudaMallocAsync(reinterpret_cast<void**>(&scratch), 1024, stream) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(scratch, out, 1024, cudaMemcpyDeviceToDevice, stream) == cudaSuccess);
  // cudaMemset2DAsync writes bytes: the byte-wide cases only.
  bool enqueued = true;
  *replaced = gpu::run_memsets_as_kernels(stream, [&](cudaStream_t s) {
    for (const MemsetCase& c : kCases) {
      if (c.element_size != 1) continue;
      enqueued = enqueued && cudaMemset2DAsync(scratch + c.offset, c.height > 1 ? c.pitch : c.width,
                                               static_cast<int>(c.value & 0xFF), c.width, c.height, s) == cudaSuccess;
    }
  });
  REQUIRE(enqueued);
  REQUIRE(cudaMemcpyAsync(out, scratch, 1024, cudaMemcpyDeviceToDevice, stream) == cudaSuccess);
  REQUIRE(cudaFreeAsync(scratch, stream) == cudaSuccess);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  *top = count_nodes(graph);
  if (top->child == 1) *inner = count_nodes(child_graph(graph));
  launch_and_wait(graph, stream);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  std::vector<unsigned char> bytes = read_back(out);
  REQUIRE(cudaFree(out) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
  return bytes;
}

}  // namespace

TEST_CASE("memset nodes of a graph become kernels that write the same bytes in the same order",
          "[kernels][cuda][graph_memset]") {
  TANDEM_REQUIRE_CUDA();
  for (const bool rewrite : {false, true}) {
    INFO((rewrite ? "rewritten" : "as memsets"));
    char* buf = nullptr;
    REQUIRE(cudaMalloc(&buf, 1024) == cudaSuccess);
    REQUIRE(cudaMemset(buf, 0, 1024) == cudaSuccess);
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaGraphCreate(&graph, 0) == cudaSuccess);
    cudaGraphNode_t prev = nullptr;
    for (const MemsetCase& c : kCases) {
      const cudaMemsetParams m = params_of(c, buf);
      cudaGraphNode_t node = nullptr;
      REQUIRE(cudaGraphAddMemsetNode(&node, graph, prev ? &prev : nullptr, prev ? 1 : 0, &m) == cudaSuccess);
      prev = node;
    }
    const size_t replaced = rewrite ? gpu::memsets_to_kernels(graph) : 0;
    const NodeCounts n = count_nodes(graph);
    CHECK(replaced == (rewrite ? kCases.size() : 0));
    CHECK(n.all == kCases.size());
    CHECK(n.memset == kCases.size() - replaced);
    CHECK(n.kernel == replaced);
    launch_and_wait(graph, nullptr);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
    CHECK(read_back(buf) == expected_bytes());
    REQUIRE(cudaFree(buf) == cudaSuccess);
  }
}

TEST_CASE("a call captured apart joins a capture that allocates, its memsets as kernels",
          "[kernels][cuda][graph_memset][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  // The byte-wide cases only: cudaMemset2DAsync writes bytes.
  std::vector<unsigned char> want(1024, 0);
  size_t byte_cases = 0;
  for (const MemsetCase& c : kCases) {
    if (c.element_size != 1) continue;
    ++byte_cases;
    for (size_t r = 0; r < c.height; ++r) {
      for (size_t b = 0; b < c.width; ++b) want[c.offset + r * c.pitch + b] = static_cast<unsigned char>(c.value);
    }
  }
  REQUIRE(byte_cases == 2);
  size_t replaced = 0;
  NodeCounts top, inner;
  SECTION("on: one child graph of kernels, no memset left") {
    CHECK(capture_apart(true, &replaced, &top, &inner) == want);
    CHECK(replaced == byte_cases);
    CHECK(top.alloc == 1);
    CHECK(top.child == 1);
    CHECK(top.memset == 0);
    CHECK(inner.memset == 0);
    CHECK(inner.kernel == byte_cases);
  }
  SECTION("off: the memsets captured in place") {
    CHECK(capture_apart(false, &replaced, &top, &inner) == want);
    CHECK(replaced == 0);
    CHECK(top.child == 0);
    CHECK(top.memset == byte_cases);
  }
}

TEST_CASE("outside a capture the work runs on the stream it was given", "[kernels][cuda][graph_memset]") {
  TANDEM_REQUIRE_CUDA();
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  cudaStream_t seen = nullptr;
  CHECK(gpu::run_memsets_as_kernels(stream, [&](cudaStream_t s) { seen = s; }) == 0);
  CHECK(seen == stream);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("convolutions replayed from a graph give the eager bits with cuDNN's memsets as kernels or not",
          "[kernels][cuda][graph_memset][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  const test::SettingRestore direct(set_direct_conv, direct_conv);
  const test::SettingRestore memsets(set_cudnn_memsets_as_kernels, cudnn_memsets_as_kernels);
  set_direct_conv(false);
  // bfloat16 channels-last, as a ResNet's step runs them; float32 NCHW too.
  const Conv2dParams p{1, 1, 1, 1};
  for (const bool bf : {true, false}) {
    INFO((bf ? "bfloat16 channels-last" : "float32"));
    const auto prep = [&](const Tensor& t) {
      return bf ? restrided(test::bf16(t).to(gpu), MemoryFormat::ChannelsLast) : t.to(gpu);
    };
    const Tensor x = prep(uniform({8, 64, 10, 10}, -1.0, 1.0)), w = prep(uniform({64, 64, 3, 3}, -0.2, 0.2));
    const Tensor dy = prep(uniform({8, 64, 10, 10}, -1.0, 1.0));
    const Tensor y = kernels::conv2d(x, w, Tensor(), p);
    const Tensor dx = kernels::conv2d_backward_input(dy, w, p, x.shape());
    const Tensor dw = std::get<0>(kernels::conv2d_backward_weight(x, dy, p, w.shape(), false));
    for (const bool on : {true, false}) {
      INFO("memsets as kernels " << on);
      set_cudnn_memsets_as_kernels(on);
      Tensor gy = zeros_like(y), gdx = zeros_like(dx), gdw = zeros_like(dw);
      CUDAGraph g;
      g.capture_begin(gpu);
      gy.copy_(kernels::conv2d(x, w, Tensor(), p));
      gdx.copy_(kernels::conv2d_backward_input(dy, w, p, x.shape()));
      gdw.copy_(std::get<0>(kernels::conv2d_backward_weight(x, dy, p, w.shape(), false)));
      g.capture_end();
      REQUIRE(g.captured());
      for (int replay = 0; replay < 2; ++replay) {
        g.replay();
        CHECK(test::values(gy) == test::values(y));
        CHECK(test::values(gdx) == test::values(dx));
        CHECK(test::values(gdw) == test::values(dw));
      }
    }
  }
}

namespace {

// The nodes a node depends on.
std::vector<cudaGraphNode_t> dependencies_of(cudaGraphNode_t node) {
  size_t n = 0;
  REQUIRE(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n) == cudaSuccess);
  std::vector<cudaGraphNode_t> in(n);
  if (n > 0) REQUIRE(cudaGraphNodeGetDependencies(node, in.data(), nullptr, &n) == cudaSuccess);
  return in;
}

cudaGraph_t child_graph_of(cudaGraphNode_t node) {
  cudaGraph_t g = nullptr;
  REQUIRE(cudaGraphChildGraphNodeGetGraph(node, &g) == cudaSuccess);
  return g;
}

bool contains(const std::vector<cudaGraphNode_t>& nodes, cudaGraphNode_t node) {
  return std::find(nodes.begin(), nodes.end(), node) != nodes.end();
}

}  // namespace

TEST_CASE("a stream's own workspace: its preparation runs after its last use, not after the call's inputs",
          "[kernels][cuda][graph_memset][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  const test::SettingRestore ahead(set_cudnn_prepare_ahead, cudnn_prepare_ahead);
  const test::SettingRestore memsets(set_cudnn_memsets_as_kernels, cudnn_memsets_as_kernels);
  set_cudnn_memsets_as_kernels(true);
  const cudaStream_t stream = current_cuda_stream(gpu);
  Tensor out = zeros({3}, kInt64, gpu), other = zeros({1}, kInt64, gpu);  // 4 bytes of each written
  auto* out_p = static_cast<char*>(out.raw_data());
  SECTION("on") {
    set_cudnn_prepare_ahead(true);
    gpu::reserve_stream_workspace(gpu, stream, 64);  // outside the capture, as a warm-up step does
    CHECK_FALSE(gpu::capture_stream_workspace(gpu, stream, 64));  // only inside a capture
    const size_t before = gpu::prepared_ahead_nodes();
    CUDAGraph g;
    g.capture_begin(gpu);
    // Three calls on the workspace: each sets its first word to k + 1 (the preparation) and
    // copies it out (the use). The third also clears a word of another buffer, which stays
    // with its call.
    std::vector<cudaGraphNode_t> calls;
    for (int k = 0; k < 3; ++k) {
      const gpu::StreamWorkspace ws = gpu::capture_stream_workspace(gpu, stream, 64);
      REQUIRE(ws);
      CHECK(ws.bytes >= 64);
      bool enqueued = true;
      gpu::run_memsets_as_kernels(
          stream,
          [&](cudaStream_t s) {
            enqueued = enqueued && cudaMemsetAsync(ws.data, k + 1, 4, s) == cudaSuccess;
            if (k == 2) enqueued = enqueued && cudaMemsetAsync(other.raw_data(), 0x55, 4, s) == cudaSuccess;
            enqueued = enqueued && cudaMemcpyAsync(out_p + 8 * k, ws.data, 4, cudaMemcpyDeviceToDevice, s) == cudaSuccess;
          },
          &ws);
      REQUIRE(enqueued);
      cudaStreamCaptureStatus status{};
      const cudaGraphNode_t* deps = nullptr;
      size_t n_deps = 0;
      REQUIRE(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, nullptr, &n_deps) == cudaSuccess);
      REQUIRE(n_deps == 1);
      calls.push_back(deps[0]);
    }
    // The first call keeps its preparation (nothing used the workspace before it in this
    // capture); each later one is its preparation's child node after the call before, then the
    // rest after both.
    CHECK(gpu::prepared_ahead_nodes() - before == 2);
    CHECK(dependencies_of(calls[0]).empty());
    CHECK(count_nodes(child_graph_of(calls[0])).kernel == 1);
    for (int k = 1; k < 3; ++k) {
      INFO("call " << k);
      const std::vector<cudaGraphNode_t> in = dependencies_of(calls[k]);
      REQUIRE(in.size() == 2);  // the call before, and the preparation
      CHECK(contains(in, calls[k - 1]));
      const cudaGraphNode_t prep = in.front() == calls[k - 1] ? in.back() : in.front();
      CHECK(dependencies_of(prep) == std::vector<cudaGraphNode_t>{calls[k - 1]});
      NodeCounts p = count_nodes(child_graph_of(prep)), rest = count_nodes(child_graph_of(calls[k]));
      CHECK(p.kernel == 1);
      CHECK(rest.kernel == (k == 2 ? 1u : 0u));  // the other buffer's clearing stays
    }
    g.capture_end();
    REQUIRE(g.captured());
    for (int replay = 0; replay < 2; ++replay) {
      g.replay();
      CHECK(test::values(out) == std::vector<double>{0x01010101, 0x02020202, 0x03030303});
      CHECK(test::values(other) == std::vector<double>{0x55555555});
    }
  }
  SECTION("off: no stream workspace") {
    set_cudnn_prepare_ahead(false);
    gpu::reserve_stream_workspace(gpu, stream, 64);
    CUDAGraph g;
    g.capture_begin(gpu);
    CHECK_FALSE(gpu::capture_stream_workspace(gpu, stream, 64));
    g.capture_end();
  }
}

TEST_CASE("convolutions replayed on new inputs give the eager bits with their workspace prepared ahead or not",
          "[kernels][cuda][graph_memset][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  const test::SettingRestore direct(set_direct_conv, direct_conv);
  const test::SettingRestore ahead(set_cudnn_prepare_ahead, cudnn_prepare_ahead);
  set_direct_conv(false);
  const auto prep = [&](const Tensor& t) { return restrided(test::bf16(t).to(gpu), MemoryFormat::ChannelsLast); };
  // ResNet's shapes at a smaller batch, bfloat16 channels-last; each plan used twice in a row
  // (the second call's preparation must wait for the first call).
  struct Layer {
    int64_t c, k, size, stride;
  };
  for (const Layer& l : {Layer{64, 64, 28, 1}, Layer{64, 128, 28, 2}, Layer{128, 128, 14, 1}, Layer{256, 256, 7, 1}}) {
    INFO(l.c << "->" << l.k << " @" << l.size << " /" << l.stride);
    const Conv2dParams p{l.stride, l.stride, 1, 1};
    const int64_t out_size = (l.size + 2 - 3) / l.stride + 1;
    const Tensor w = prep(uniform({l.k, l.c, 3, 3}, -0.2, 0.2));
    Tensor x = prep(uniform({32, l.c, l.size, l.size}, -1.0, 1.0));
    Tensor dy = prep(uniform({32, l.k, out_size, out_size}, -1.0, 1.0));
    const std::vector<Tensor> x_next = {prep(uniform(x.shape(), -1.0, 1.0)), prep(uniform(x.shape(), -1.0, 1.0))};
    const std::vector<Tensor> dy_next = {prep(uniform(dy.shape(), -1.0, 1.0)), prep(uniform(dy.shape(), -1.0, 1.0))};
    auto passes = [&](const Tensor& xi, const Tensor& dyi) {
      std::vector<Tensor> r;
      for (int twice = 0; twice < 2; ++twice) {
        r.push_back(kernels::conv2d(xi, w, Tensor(), p));
        r.push_back(kernels::conv2d_backward_input(dyi, w, p, xi.shape()));
        r.push_back(std::get<0>(kernels::conv2d_backward_weight(xi, dyi, p, w.shape(), false)));
      }
      return r;
    };
    for (const bool on : {true, false}) {
      INFO("prepared ahead " << on);
      set_cudnn_prepare_ahead(on);
      // The warm-up (plans made, the stream's workspace reserved); the graph's outputs made
      // before the capture, which keeps none of its own.
      std::vector<Tensor> got;
      for (const Tensor& t : passes(x, dy)) got.push_back(zeros_like(t));
      const size_t before = gpu::prepared_ahead_nodes();
      CUDAGraph g;
      g.capture_begin(gpu);
      {
        const std::vector<Tensor> r = passes(x, dy);
        for (size_t i = 0; i < r.size(); ++i) got[i].copy_(r[i]);
      }
      g.capture_end();
      REQUIRE(g.captured());
      if (!on) CHECK(gpu::prepared_ahead_nodes() == before);
      UNSCOPED_INFO("preparation nodes moved ahead: " << gpu::prepared_ahead_nodes() - before);
      for (size_t r = 0; r < x_next.size(); ++r) {
        x.copy_(x_next[r]);
        dy.copy_(dy_next[r]);
        g.replay();
        const std::vector<Tensor> want = passes(x, dy);
        for (size_t i = 0; i < want.size(); ++i) {
          INFO("replay " << r << ", pass " << i);
          CHECK(test::values(got[i]) == test::values(want[i]));
        }
      }
    }
  }
}
#endif
