// Note [memsets of a captured graph as kernels]: some of cuDNN's sm90 convolution kernels are
// preceded, in every call, by a 4-byte cudaMemsetAsync (a counter the kernel's tiles share),
// and captured into a CUDA graph it becomes a memset node. In ResNet-18's replayed step on an
// H200 (26 of them in 346 nodes) each such node took ~1.7 us, the kernel before it ended
// ~4.6 us before it started and the convolution after it began ~3.8 us after it ended, where
// two kernels follow each other by ~0.4 us: a memset node is not run by the multiprocessors,
// and handing work from them to it and back costs far more than the four bytes. Large memsets
// of the same graph (zeroing the gradients, cuDNN's padded copies) showed no such gaps.
//
// So before a captured graph is instantiated, each of its memset nodes is replaced by a kernel
// node that writes the same bytes -- the same value, element size, rows and pitch -- with the
// same dependencies in and out; the graph's work and its order are unchanged. A node whose
// edges carry data (programmatic launches) is left alone. Environment:
// TANDEM_GRAPH_MEMSET_KERNELS=0 turns it off (kernels/backend.h).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/backend.h"
#include "kernels/cuda/graph_memset.h"

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
  k.blockDim = dim3(kThreads);
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
  if (m.width == 0 || m.height == 0) return false;  // nothing to write: leave it as it is
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

}  // namespace

size_t memsets_to_kernels(cudaGraph_t graph) {
  if (!graph_memset_kernels()) return 0;
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

}  // namespace tandem::gpu
