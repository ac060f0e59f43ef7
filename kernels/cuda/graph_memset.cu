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
//
// Note [a workspace prepared ahead]: with the memsets as kernels, a replayed ResNet-18 step
// still ran, before most convolutions, a short chain on the stream's critical path: the
// counter's clearing (a 1 us kernel) and, before many input gradients, cuDNN's own
// init_device_workspace_kernel (3.5 us), each with a launch gap after it, about 60 us of a
// 3.1 ms step (H100). Neither reads the call's tensors: they prepare its workspace. They wait
// for the call's inputs only because the workspace is allocated in stream order just before
// the call, where its memory may have been another tensor's a moment before.
//
// So inside a capture a call may take its stream's own workspace instead: a block the stream
// keeps (reserve_stream_workspace, at the eager steps before a capture, up to 16 MB, grown to
// the largest call's need), which only the captured calls on that stream use, and which every
// graph using it keeps alive (capture_memory_keep in core/allocator.h). Its only other users are
// then the calls before on the same stream, so the call's small graph (above) is split: the
// nodes that only prepare the workspace -- a fill that replaced a memset inside the block, or
// a kernel named init_device_workspace, with nothing but such nodes before them -- become a
// child graph node of their own that depends only on the previous call's node that used the
// block in this capture, and the rest of the call depends on it and on the call's inputs, as
// before. The preparation then runs beside the batch norm passes between two convolutions,
// off the critical path; the work and the bytes written are the same, only the order between
// unrelated nodes changes. The block's first call in a capture keeps its preparation in line:
// with nothing before it, it would be one of the graph's first nodes, and a replay's first
// nodes start about 12 us apart on an H100 (three such preparations put the images' gather
// 28 us into the replay instead of 12).
//
// What this relies on: that cuDNN's workspace initialisation touches nothing but the workspace
// (its name, and the tests that replay convolutions on new inputs against eager runs); and
// that graphs captured on one stream are not replayed at the same time on two streams (they
// would share the stream's workspace; graphs replayed on the stream they were captured on
// never are). Calls outside a capture are unchanged: they take a block in stream order.
// Measured on ResNet-18's step (bf16, channels-last, timed engines; H100, one build, off
// against on, with the first calls' preparations still moved): 83.6k -> 84.4k images/s, the
// peak 730 -> 739 MB. Environment: TANDEM_CUDNN_PREPARE_AHEAD=0 turns it off (kernels/backend.h).

#include "kernels/cuda/graph_memset.h"

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "core/allocator.h"
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

// A node's dependencies and dependents, and whether every edge of it is a plain one.
struct Edges {
  std::vector<cudaGraphNode_t> in, out;
  bool plain;
};
Edges edges_of(cudaGraphNode_t node) {
  size_t n_in = 0, n_out = 0;
  TANDEM_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n_in));
  TANDEM_CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &n_out));
  Edges e{std::vector<cudaGraphNode_t>(n_in), std::vector<cudaGraphNode_t>(n_out), true};
  std::vector<cudaGraphEdgeData> in_edges(n_in), out_edges(n_out);
  if (n_in > 0) TANDEM_CUDA_CHECK(cudaGraphNodeGetDependencies(node, e.in.data(), in_edges.data(), &n_in));
  if (n_out > 0) TANDEM_CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, e.out.data(), out_edges.data(), &n_out));
  e.plain = default_edges(in_edges) && default_edges(out_edges);
  return e;
}

// A kernel node that replaced a memset, and the bytes it writes, [begin, end).
struct Fill {
  cudaGraphNode_t node;
  uintptr_t begin, end;
};

// Replaces one memset node; false (the graph unchanged) when its edges carry data.
bool replace_memset(cudaGraph_t graph, cudaGraphNode_t node, std::vector<Fill>* fills) {
  cudaMemsetParams m{};
  TANDEM_CUDA_CHECK(cudaGraphMemsetNodeGetParams(node, &m));
  const Edges e = edges_of(node);
  if (!e.plain) return false;
  const std::vector<cudaGraphNode_t>&in = e.in, &out = e.out;
  const size_t n_in = in.size();
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
  if (fills != nullptr) {
    const auto begin = reinterpret_cast<uintptr_t>(m.dst);
    const size_t row_bytes = m.width * m.elementSize;
    fills->push_back({fill, begin, begin + (m.height > 1 ? (m.height - 1) * m.pitch : 0) + row_bytes});
  }
  return true;
}

size_t replace_memsets(cudaGraph_t graph, std::vector<Fill>* fills) {
  size_t n = 0;
  TANDEM_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0) TANDEM_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  size_t replaced = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    TANDEM_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeMemset && replace_memset(graph, node, fills)) ++replaced;
  }
  return replaced;
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

// ---- Note [a workspace prepared ahead] ------------------------------------------------------

// The most a stream keeps as its own workspace. ResNet-18's calls that clear or initialise their
// workspace need far less; a call that needs more takes a block of its own, as outside a capture.
constexpr size_t kStreamWorkspaceMax = size_t{16} << 20;

// A stream's own workspace, and its last use in the capture under way.
struct StreamSlot {
  Device device;
  cudaStream_t stream = nullptr;
  DataPtr block;
  size_t bytes = 0;
  unsigned long long capture_id = 0;   // the capture that last_use belongs to (0: none)
  cudaGraphNode_t last_use = nullptr;  // the child node of that capture that used the block last
};

// This thread's slots; unique_ptr, so that a StreamWorkspace's slot pointer stays valid.
thread_local std::vector<std::unique_ptr<StreamSlot>> tls_slots;

StreamSlot* slot_of(Device device, cudaStream_t stream) {
  for (const auto& slot : tls_slots) {
    if (slot->device == device && slot->stream == stream) return slot.get();
  }
  return nullptr;
}

std::atomic<size_t> g_prepared_ahead{0};

// The name of the kernel a kernel node launches, through the driver (a library's kernels are
// the driver's functions, which the runtime cannot name); null when the driver cannot say.
const char* kernel_node_name(cudaGraphNode_t node) {
  using GetParams = CUresult (*)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*);
  using FuncName = CUresult (*)(const char**, CUfunction);
  using KernelName = CUresult (*)(const char**, CUkernel);
  struct Entry {
    GetParams get_params = nullptr;
    FuncName func_name = nullptr;
    KernelName kernel_name = nullptr;
    Entry() {
      void* f = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion("cuGraphKernelNodeGetParams", &f, 12000, cudaEnableDefault, &q) ==
              cudaSuccess && q == cudaDriverEntryPointSuccess)
        get_params = reinterpret_cast<GetParams>(f);
      if (cudaGetDriverEntryPointByVersion("cuFuncGetName", &f, 12030, cudaEnableDefault, &q) == cudaSuccess &&
          q == cudaDriverEntryPointSuccess)
        func_name = reinterpret_cast<FuncName>(f);
      if (cudaGetDriverEntryPointByVersion("cuKernelGetName", &f, 12030, cudaEnableDefault, &q) == cudaSuccess &&
          q == cudaDriverEntryPointSuccess)
        kernel_name = reinterpret_cast<KernelName>(f);
      (void)cudaGetLastError();
    }
  };
  static const Entry entry;
  if (entry.get_params == nullptr) return nullptr;
  CUDA_KERNEL_NODE_PARAMS p{};
  if (entry.get_params(node, &p) != CUDA_SUCCESS) return nullptr;
  const char* name = nullptr;
  if (p.func != nullptr && entry.func_name != nullptr && entry.func_name(&name, p.func) == CUDA_SUCCESS) return name;
  if (p.func == nullptr && p.kern != nullptr && entry.kernel_name != nullptr &&
      entry.kernel_name(&name, p.kern) == CUDA_SUCCESS)
    return name;
  return nullptr;
}

// Whether `node` of a captured library call only prepares the workspace [begin, end): a fill
// that replaced a memset inside it, or cuDNN's workspace initialisation kernel, which reads
// none of the call's tensors (it runs before the convolution, on the workspace alone, in every
// engine that has it).
bool prepares_workspace(cudaGraphNode_t node, const std::vector<Fill>& fills, uintptr_t begin, uintptr_t end) {
  for (const Fill& f : fills) {
    if (f.node == node) return f.begin >= begin && f.end <= end;
  }
  cudaGraphNodeType type{};
  TANDEM_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
  if (type != cudaGraphNodeTypeKernel) return false;
  const char* name = kernel_node_name(node);
  return name != nullptr && std::strstr(name, "init_device_workspace") != nullptr;
}

std::vector<cudaGraphNode_t> nodes_of(cudaGraph_t graph) {
  size_t n = 0;
  TANDEM_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0) TANDEM_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  return nodes;
}

// The nodes of `small` that prepare the workspace and depend on nothing else: each is one
// (prepares_workspace), all its dependencies are among them, and its edges are plain.
std::vector<cudaGraphNode_t> preparation_nodes(cudaGraph_t small, const std::vector<Fill>& fills,
                                               const StreamWorkspace& ws) {
  const auto begin = reinterpret_cast<uintptr_t>(ws.data), end = begin + ws.bytes;
  const std::vector<cudaGraphNode_t> nodes = nodes_of(small);
  std::vector<cudaGraphNode_t> prep;
  auto in_prep = [&](cudaGraphNode_t n) { return std::find(prep.begin(), prep.end(), n) != prep.end(); };
  for (bool grew = true; grew;) {  // a few nodes: repeat until no node joins
    grew = false;
    for (cudaGraphNode_t node : nodes) {
      if (in_prep(node) || !prepares_workspace(node, fills, begin, end)) continue;
      const Edges e = edges_of(node);
      if (!e.plain || !std::all_of(e.in.begin(), e.in.end(), in_prep)) continue;
      prep.push_back(node);
      grew = true;
    }
  }
  if (prep.size() == nodes.size()) prep.clear();  // nothing left to prepare for
  return prep;
}

// Moves the nodes `prep` of `small` into a graph of their own (returned; `small` keeps the
// rest). Edges between the two parts go: the caller orders the whole of the rest after it.
cudaGraph_t split_off(cudaGraph_t small, const std::vector<cudaGraphNode_t>& prep) {
  cudaGraph_t ahead = nullptr;
  TANDEM_CUDA_CHECK(cudaGraphClone(&ahead, small));
  for (cudaGraphNode_t node : nodes_of(small)) {
    if (std::find(prep.begin(), prep.end(), node) != prep.end()) continue;
    cudaGraphNode_t copy = nullptr;
    TANDEM_CUDA_CHECK(cudaGraphNodeFindInClone(&copy, node, ahead));
    TANDEM_CUDA_CHECK(cudaGraphDestroyNode(copy));
  }
  for (cudaGraphNode_t node : prep) TANDEM_CUDA_CHECK(cudaGraphDestroyNode(node));
  return ahead;
}

cudaGraphNode_t add_child(cudaGraph_t step, cudaGraph_t child, const cudaGraphNode_t* deps,
                          const cudaGraphEdgeData* edges, size_t n_deps) {
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeGraph;
  params.graph.graph = child;  // cloned into the step's graph
  cudaGraphNode_t node = nullptr;
  TANDEM_CUDA_CHECK(cudaGraphAddNode(&node, step, deps, edges, n_deps, &params));
  return node;
}

}  // namespace

void reserve_stream_workspace(Device device, cudaStream_t stream, size_t bytes) {
  if (bytes == 0 || bytes > kStreamWorkspaceMax || !cudnn_prepare_ahead()) return;
  StreamSlot* slot = slot_of(device, stream);
  if (slot == nullptr) {
    tls_slots.push_back(std::make_unique<StreamSlot>());
    slot = tls_slots.back().get();
    slot->device = device;
    slot->stream = stream;
  }
  if (slot->bytes >= bytes) return;
  // The block before goes when nothing holds it: graphs that used it keep it
  // (capture_memory_keep), and its free is ordered after the stream's work so far.
  const size_t grown = std::min(kStreamWorkspaceMax, std::max(bytes, 2 * slot->bytes));
  slot->block = allocate(device, grown);
  slot->bytes = grown;
  slot->capture_id = 0;
  slot->last_use = nullptr;
}

StreamWorkspace capture_stream_workspace(Device device, cudaStream_t stream, size_t bytes) {
  if (bytes == 0 || !cudnn_prepare_ahead() || !cudnn_memsets_as_kernels()) return {};
  StreamSlot* slot = slot_of(device, stream);
  if (slot == nullptr || slot->bytes < bytes) return {};
  if (!capture_memory_keep(device, stream, slot->block)) return {};
  return {slot->block.get(), slot->bytes, slot};
}

size_t prepared_ahead_nodes() { return g_prepared_ahead.load(std::memory_order_relaxed); }

size_t memsets_to_kernels(cudaGraph_t graph) { return replace_memsets(graph, nullptr); }

size_t run_memsets_as_kernels(cudaStream_t stream, const std::function<void(cudaStream_t)>& work,
                              const StreamWorkspace* ahead) {
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
  std::vector<Fill> fills;
  const size_t replaced = replace_memsets(small.g, &fills);
  size_t n = 0;
  TANDEM_CUDA_CHECK(cudaGraphGetNodes(small.g, nullptr, &n));
  if (n == 0) return replaced;  // the call enqueued nothing
  // The child node after what `stream`'s capture would have run next, with the same edges.
  cudaGraph_t step = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t n_deps = 0;
  unsigned long long capture_id = 0;
  TANDEM_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &capture_id, &step, &deps, &edges, &n_deps));
  TANDEM_CHECK(status == cudaStreamCaptureStatusActive, Cuda,
               "cuDNN call in a CUDA graph capture: the capture ended while the call was captured apart");
  std::vector<cudaGraphNode_t> dep_nodes(deps, deps + n_deps);
  std::vector<cudaGraphEdgeData> dep_edges(n_deps);
  if (edges != nullptr) std::copy(edges, edges + n_deps, dep_edges.begin());  // null: default edges
  auto* slot = ahead != nullptr && *ahead ? static_cast<StreamSlot*>(ahead->slot) : nullptr;
  if (slot != nullptr && slot->capture_id == capture_id && slot->last_use != nullptr) {
    // Note [a workspace prepared ahead]: the preparation after the block's last use in this
    // capture, the rest after it and the call's inputs. (The block's first use in a capture
    // keeps its preparation: moved ahead it would be one of the graph's first nodes.)
    const std::vector<cudaGraphNode_t> prep = preparation_nodes(small.g, fills, *ahead);
    if (!prep.empty()) {
      GraphOwner first;
      first.g = split_off(small.g, prep);
      dep_nodes.push_back(add_child(step, first.g, &slot->last_use, nullptr, 1));
      dep_edges.push_back(cudaGraphEdgeData{});
      g_prepared_ahead.fetch_add(prep.size(), std::memory_order_relaxed);
    }
  }
  cudaGraphNode_t child = add_child(step, small.g, dep_nodes.data(), dep_edges.data(), dep_nodes.size());
  TANDEM_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(stream, &child, nullptr, 1, cudaStreamSetCaptureDependencies));
  if (slot != nullptr) {
    slot->capture_id = capture_id;
    slot->last_use = child;
  }
  return replaced;
}

}  // namespace tandem::gpu
