// A kernel timeline of any CUDA program, tandem's or PyTorch's, from the GPU's own timestamps.
//
// Nsight Compute profiles one kernel at a time, replaying it in isolation: right for a kernel's
// own cost, wrong for a step of 60 small kernels replayed from a CUDA graph, where what counts is
// how the kernels follow each other on the GPU (launch latency between graph nodes, tails, the
// gaps). Nsight Systems is not on every machine. This library records what actually ran, with
// CUPTI's activity API (the interface both profilers are built on): every kernel, memcpy and
// memset with its start and end on the GPU clock, its stream, and the correlation id of the
// host call that launched it -- all kernels of one cudaGraphLaunch share that id, which is how
// bench/timeline_summary.py finds the replays of a graph.
//
// It is loaded by the CUDA driver itself, through CUDA's injection hook, so the program needs
// no change and no rebuild:
//
//   CUDA_INJECTION64_PATH=build-gpu/bench/libtandem_kernel_timeline.so TANDEM_TIMELINE=out.json
//       build-gpu/bench/bench_train --model lenet ...
//
// The driver calls InitializeInjection() at cuInit; the records are written at exit as a
// Chrome trace (open it in https://ui.perfetto.dev), one "X" event per kernel with "cat":
// "kernel" (as PyTorch's profiler writes its own traces, so the same summary reads both), the
// timestamps in microseconds from the first record. Activity records are collected into
// buffers CUPTI asks for and hands back when full, so tracing costs the program little host
// time and none on the GPU; a trace of many steps is large, so bound the run (--epochs 1 ...).
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cxxabi.h>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

// One activity, copied out of CUPTI's buffer (the name pointer stays valid: CUPTI owns the
// strings for the life of the process).
struct Record {
  std::string cat;  // kernel | memcpy | memset
  std::string name;
  uint64_t start = 0, end = 0;
  uint32_t device = 0, stream = 0, correlation = 0, graph = 0;
};

std::mutex g_mutex;
std::vector<Record>* g_records = nullptr;  // leaked on purpose: written from an atexit handler

constexpr size_t kBufferBytes = 8u << 20;

bool check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return true;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kernel_timeline: %s failed: %s\n", what, msg ? msg : "unknown error");
  return false;
}

std::string demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Record> got;
  CUpti_Activity* a = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &a) == CUPTI_SUCCESS) {
    Record r;
    switch (a->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(a);
        r = {"kernel", demangle(k->name), k->start, k->end, k->deviceId, k->streamId, k->correlationId, k->graphId};
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(a);
        r = {"memcpy", "memcpy " + std::to_string(m->bytes) + " B", m->start, m->end,
             m->deviceId, m->streamId, m->correlationId, m->graphId};
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(a);
        r = {"memset", "memset " + std::to_string(m->bytes) + " B", m->start, m->end,
             m->deviceId, m->streamId, m->correlationId, m->graphId};
        break;
      }
      default:
        continue;
    }
    got.push_back(std::move(r));
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped != 0) std::fprintf(stderr, "kernel_timeline: %zu records dropped\n", dropped);
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_records->insert(g_records->end(), std::make_move_iterator(got.begin()), std::make_move_iterator(got.end()));
}

void write_trace() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const char* env = std::getenv("TANDEM_TIMELINE");
  const std::string path = env && *env ? env : "kernel_timeline.json";
  std::lock_guard<std::mutex> lock(g_mutex);
  uint64_t origin = UINT64_MAX;
  for (const Record& r : *g_records) origin = std::min(origin, r.start);
  nlohmann::json events = nlohmann::json::array();
  for (const Record& r : *g_records) {
    events.push_back({{"name", r.name},
                      {"cat", r.cat},
                      {"ph", "X"},
                      {"ts", static_cast<double>(r.start - origin) / 1e3},
                      {"dur", static_cast<double>(r.end - r.start) / 1e3},
                      {"pid", r.device},
                      {"tid", r.stream},
                      {"args", {{"correlation", r.correlation}, {"graph", r.graph}}}});
  }
  // Written to a temporary name and renamed, so a reader never sees half a trace.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ns"}}.dump() << "\n";
    if (!out) {
      std::fprintf(stderr, "kernel_timeline: cannot write %s\n", tmp.c_str());
      return;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "kernel_timeline: cannot rename %s to %s\n", tmp.c_str(), path.c_str());
    return;
  }
  std::fprintf(stderr, "kernel_timeline: %zu records in %s\n", g_records->size(), path.c_str());
}

}  // namespace

// CUDA's injection entry point (CUDA_INJECTION64_PATH): called once, at cuInit.
extern "C" __attribute__((visibility("default"))) int InitializeInjection() {
  g_records = new std::vector<Record>();
  if (!check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks"))
    return 0;
  // CONCURRENT_KERNEL, not KERNEL: the latter serializes the kernels it records.
  for (CUpti_ActivityKind kind : {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                  CUPTI_ACTIVITY_KIND_MEMSET})
    if (!check(cuptiActivityEnable(kind), "cuptiActivityEnable")) return 0;
  std::atexit(write_trace);
  return 1;
}
