#pragma once
// What the GPU bench programs share: timing a step with CUDA events, and comparing two results.
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/cuda_graph.h"
#include "core/cuda_stream.h"
#include "core/tensor.h"

namespace tandem::bench {

// The median time of step() over `runs` runs on stream s, in microseconds, divided by `calls`
// (the calls a step makes): an event recorded before the first run and after each.
inline double median_us(cudaStream_t s, int runs, const std::function<void()>& step, int calls = 1) {
  std::vector<cudaEvent_t> ev(static_cast<size_t>(runs) + 1);
  for (auto& e : ev) TANDEM_CUDA_CHECK(cudaEventCreate(&e));
  TANDEM_CUDA_CHECK(cudaEventRecord(ev[0], s));
  for (int i = 0; i < runs; ++i) {
    step();
    TANDEM_CUDA_CHECK(cudaEventRecord(ev[static_cast<size_t>(i) + 1], s));
  }
  TANDEM_CUDA_CHECK(cudaEventSynchronize(ev.back()));
  std::vector<double> us;
  for (size_t i = 0; i + 1 < ev.size(); ++i) {
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    us.push_back(1000.0 * ms / calls);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// The median time of one call of f inside a replayed CUDA graph of `calls` calls on `device`,
// in microseconds over `runs` replays: the time a call takes inside a replayed training step,
// launch gaps included. f runs twice first, outside the capture (plans made, engines timed).
inline double replayed_call_us(Device device, int runs, const std::function<void()>& f, int calls = 20) {
  f();
  f();
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(current_cuda_stream(device)));
  CUDAGraph graph;
  graph.capture_begin(device);
  for (int i = 0; i < calls; ++i) f();
  graph.capture_end();
  graph.replay();
  return median_us(current_cuda_stream(device), runs, [&] { graph.replay(); }, calls);
}

// max |a - b| / max |b| (max |a - b| where b is all zeros), on the host in float64.
inline double relative_error(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(kFloat64).contiguous().to(kCPU), hb = b.to(kFloat64).contiguous().to(kCPU);
  const double* pa = ha.data<double>();
  const double* pb = hb.data<double>();
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < ha.numel(); ++i) {
    diff = std::max(diff, std::fabs(pa[i] - pb[i]));
    scale = std::max(scale, std::fabs(pb[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

}  // namespace tandem::bench
