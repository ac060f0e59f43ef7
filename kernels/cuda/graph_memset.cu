// Note [cuDNN's memsets in a captured graph]: many of cuDNN's sm_90 convolution engines clear a
// few bytes of their workspace (a 4-byte counter the kernel's tiles share) with a
// cudaMemsetAsync before the kernel, in every call, and captured into a CUDA graph it becomes a
// memset node. In ResNet-18's replayed step on an H200 (23 of them in 324 nodes) each such node
// took ~1.5 us, the kernel before it ended ~4.5 us before it started and the convolution after
// it began ~3.7 us after it ended, where one kernel follows another by ~0.4 us: a memset node is
// not run as the graph's kernels are, and handing over to it and back costs far more than the
// four bytes. Large memsets of the same graph (zeroing the gradients) showed no such gaps.
//
// A kernel that writes the same bytes does the same work without the hand-overs. But the node
// cannot be swapped in the step's graph: a graph that holds allocation or free nodes -- every
// step's does, its activations are allocated inside it -- refuses to have any node or edge
// removed. So the swap happens before the node reaches that graph: inside a capture, each
// graph-API cuDNN call runs on a stream of its own (same device, same priority) captured into a
// small graph of its own; that graph, which allocates nothing, has its memsets replaced by
// kernel nodes writing the same value, element size, rows and pitch, with the same edges; and it
// joins the step's capture as one child graph node placed after everything captured so far on
// the calling stream, which the capture then continues from. The work and its order are
// unchanged; outside a capture nothing happens. Measured on ResNet-18's step (bf16,
// channels-last, timed engines; H100, one build, off against on): 23 of the 24 memset nodes
// gone (the one left zeroes the gradient buffer), idle time inside the graph 204 -> 89 us, the
// replay 3573 -> 3333 us, 75.7k -> 77.9k images/s. Environment: TANDEM_CUDNN_MEMSET_KERNELS=0
// turns it off (kernels/backend.h).
#include "kernels/cuda/graph_memset.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/backend.h"

namespace tandem::gpu {

namespace {

// Writes `word` into row_words words of each of `rows` rows, `pitch` bytes apart, from dst.
template <typename W>
__global__ void fill_rows_kernel(char* dst, size_t pitch, W word, size_t row_words, size_t rows) {
  const size_t total = row_words * rows;
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const size_t r = i / row_words;
    reinterpret_cast<W*>(dst + r * pitch)[i - r * row_words] = word;
  }
}

// Adds to `graph`, after the nodes `in`, a kernel node that writes what the memset m writes, in
// words of W bytes (each the element repeated).
template <typename W>
cudaGraphNode_t add_fill_node(cudaGraph_t graph, const cudaMemsetParams& m, const cudaGraphNode_t* in, size_t n_in) {
  unsigned char element[4];
  std::memcpy(element, &m.value, sizeof element);  // its low elementSize bytes, little-endian
  W word;
  auto* bytes = reinterpret_cast<unsigned char*>(&word);
  for (size_t b = 0; b < sizeof(W); ++b) bytes[b] = element[b % m.elementSize];
  const size_t row_bytes = m.width * m.elementSize;
  char* dst = static_cast<char*>(m.dst);
  size_t pitch = m.height > 1 ? m.pitch : row_bytes, row_words = row_bytes / sizeof(W), rows = m.height;
  void* args[] = {&dst, &pitch, &word, &row_words, &rows};
  constexpr size_t kThreads = 256;
  const size_t blocks = std::min<size_t>((row_words * rows + kThreads - 1) / kThreads, 132 * 8);
  cudaKernelNodeParams k{};
  k.func = reinterpret_cast<void*>(&fill_rows_kernel<W>);
  k.gridDim = dim3(static_cast<unsigned>(std::max<size_t>(blocks, 1)));
  k.blockDim = dim3(static_cast<unsigned>(std::min(kThreads, std::max<size_t>(row_words * rows, 32))));
  k.kernelParams = args;
  cudaGraphNode_t fill = nullptr;
  TANDEM_CUDA_CHECK(cudaGraphAddKernelNode(&fill, graph, in, n_in, &k));  // copies the arguments
  return fill;
}

// The widest word (16, 8, 4, 2 or 1 bytes, and at least the element) that the destination, the
// rows and the pitch are all multiples of.
size_t word_bytes(const cudaMemsetParams& m) {
  const size_t row_bytes = m.width * m.elementSize;
  const auto addr = reinterpret_cast<uintptr_t>(m.dst);
  for (size_t w = 16; w > m.elementSize; w /= 2) {
    if (addr % w == 0 && row_bytes % w == 0 && (m.height <= 1 || m.pitch % w == 0)) return w;
  }
  return m.elementSize;
}

bool default_edges(const std::vector<cudaGraphEdgeData>& edges) {
  for (const cudaGraphEdgeData& e : edges) {
    if (e.from_port != 0 || e.to_port != 0 || e.type != cudaGraphDependencyTypeDefault) return false;
  }
  return true;
}

// Replaces one memset node; false (the graph unchanged) when its edges carry data.
bool replace_memset(cudaGraph_t graph, cudaGraphNode_t node) {
  cudaMemsetParams m{};
  TANDEM_CUDA_CHECK(cudaGraphMemsetNodeGetParams(node, &m));
  size_t n_in = 0, n_out = 0;
  TANDEM_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n_in));
  TANDEM_CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &n_out));
  std::vector<cudaGraphNode_t> in(n_in), out(n_out);
  std::vector<cudaGraphEdgeData> in_edges(n_in), out_edges(n_out);
  if (n_in > 0) TANDEM_CUDA_CHECK(cudaGraphNodeGetDependencies(node, in.data(), in_edges.data(), &n_in));
  if (n_out > 0) TANDEM_CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, out.data(), out_edges.data(), &n_out));
  if (!default_edges(in_edges) || !default_edges(out_edges)) return false;
  if (m.width == 0 || m.height == 0 || m.elementSize == 0) return false;  // nothing to write: left as it is
  cudaGraphNode_t (*add)(cudaGraph_t, const cudaMemsetParams&, const cudaGraphNode_t*, size_t) =
      add_fill_node<uint8_t>;
  switch (word_bytes(m)) {
    case 16: add = add_fill_node<uint4>; break;
    case 8: add = add_fill_node<uint2>; break;
    case 4: add = add_fill_node<uint32_t>; break;
    case 2: add = add_fill_node<uint16_t>; break;
    default: break;
  }
  cudaGraphNode_t fill = add(graph, m, in.data(), n_in);
  for (cudaGraphNode_t d : out) TANDEM_CUDA_CHECK(cudaGraphAddDependencies(graph, &fill, &d, nullptr, 1));
  TANDEM_CUDA_CHECK(cudaGraphDestroyNode(node));  // and its edges
  return true;
}

// This thread's uncaptured streams, one per device and priority, for the small captures.
class ScratchStreams {
 public:
  ~ScratchStreams() {
    for (auto& [key, s] : streams_) (void)cudaStreamDestroy(s);  // at thread exit; the runtime may be gone
  }
  cudaStream_t get(int device, int priority) {
    for (auto& [key, s] : streams_) {
      if (key == std::make_pair(device, priority)) return s;
    }
    cudaStream_t s = nullptr;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
    streams_.emplace_back(std::make_pair(device, priority), s);
    return s;
  }

 private:
  std::vector<std::pair<std::pair<int, int>, cudaStream_t>> streams_;
};

thread_local ScratchStreams tls_scratch;

// Owns a cudaGraph_t.
struct GraphOwner {
  cudaGraph_t g = nullptr;
  GraphOwner() = default;
  ~GraphOwner() {
    if (g != nullptr) cudaGraphDestroy(g);
  }
  GraphOwner(const GraphOwner&) = delete;
  GraphOwner& operator=(const GraphOwner&) = delete;
};

}  // namespace

size_t memsets_to_kernels(cudaGraph_t graph) {
  size_t n = 0;
  TANDEM_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0) TANDEM_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  size_t replaced = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    TANDEM_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeMemset && replace_memset(graph, node)) ++replaced;
  }
  return replaced;
}

size_t run_memsets_as_kernels(cudaStream_t stream, const std::function<void(cudaStream_t)>& work) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TANDEM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusActive || !cudnn_memsets_as_kernels()) {
    work(stream);
    return 0;
  }
  int device = 0, priority = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&device));
  TANDEM_CUDA_CHECK(cudaStreamGetPriority(stream, &priority));
  cudaStream_t scratch = tls_scratch.get(device, priority);
  // The small capture: thread-local like the step's, so only this thread's calls could break it.
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(scratch, cudaStreamCaptureModeThreadLocal));
  GraphOwner small;
  try {
    work(scratch);
  } catch (...) {
    if (cudaStreamEndCapture(scratch, &small.g) != cudaSuccess) (void)cudaGetLastError();
    throw;
  }
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(scratch, &small.g));
  const size_t replaced = memsets_to_kernels(small.g);
  size_t n = 0;
  TANDEM_CUDA_CHECK(cudaGraphGetNodes(small.g, nullptr, &n));
  if (n == 0) return replaced;  // the call enqueued nothing
  // The child node after what `stream`'s capture would have run next, with the same edges.
  cudaGraph_t step = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t n_deps = 0;
  TANDEM_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &step, &deps, &edges, &n_deps));
  TANDEM_CHECK(status == cudaStreamCaptureStatusActive, Cuda,
               "cuDNN call in a CUDA graph capture: the capture ended while the call was captured apart");
  const std::vector<cudaGraphNode_t> dep_nodes(deps, deps + n_deps);
  std::vector<cudaGraphEdgeData> dep_edges(n_deps);
  if (edges != nullptr) std::copy(edges, edges + n_deps, dep_edges.begin());  // null: default edges
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeGraph;
  params.graph.graph = small.g;  // cloned into the step's graph
  cudaGraphNode_t child = nullptr;
  TANDEM_CUDA_CHECK(cudaGraphAddNode(&child, step, dep_nodes.data(), dep_edges.data(), n_deps, &params));
  TANDEM_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(stream, &child, nullptr, 1, cudaStreamSetCaptureDependencies));
  return replaced;
}

}  // namespace tandem::gpu
