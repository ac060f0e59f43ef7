// Allreduce bus bandwidth of tandem's three communicators (naive, ring, NCCL) on every GPU of
// the machine, from 4 KB to 256 MB of float32, one JSON line per (algorithm, size).
//
// Time per call = median over repetitions of (host time of `iters` back-to-back calls after a
// synchronize, until all devices synchronize) / iters. Bus bandwidth = bytes * 2(n-1)/n / time,
// the convention of nccl-tests, so the figure is comparable across device counts and with
// PyTorch's (bench/torch_parallel.py measures its NCCL allreduce the same way).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "parallel/comm.h"

using namespace tandem;

int main(int argc, char** argv) {
  try {
    int n = cuda_device_count();
    if (n < 2) {
      std::fprintf(stderr, "bench_allreduce: needs at least 2 GPUs, found %d\n", n);
      return 1;
    }
    std::vector<Device> devices;
    for (int i = 0; i < n; ++i) devices.push_back(Device::cuda(i));
    std::vector<std::string> algos = {"naive", "ring", "nccl"};
    if (argc > 1) algos = {argv[1]};
    for (const std::string& algo : algos) {
      auto comm = parallel::make_communicator(algo, devices);
      for (int64_t bytes = 4096; bytes <= (int64_t(256) << 20); bytes *= 4) {
        int64_t count = bytes / 4;
        std::vector<Tensor> bufs;
        for (Device d : devices) bufs.push_back(rand({count}, kFloat32, d));
        int iters = bytes >= (int64_t(64) << 20) ? 5 : 20;
        for (int w = 0; w < 3; ++w) comm->allreduce_sum(bufs);
        std::vector<double> times;
        for (int rep = 0; rep < 5; ++rep) {
          synchronize_all();
          auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < iters; ++i) comm->allreduce_sum(bufs);
          synchronize_all();
          times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
        }
        std::sort(times.begin(), times.end());
        double t = times[times.size() / 2];
        double busbw = static_cast<double>(bytes) * 2.0 * (n - 1) / n / t / 1e9;
        std::printf("{\"kind\": \"allreduce\", \"framework\": \"tandem\", \"algo\": \"%s\", \"devices\": %d, "
                    "\"bytes\": %lld, \"time_us\": %.2f, \"busbw_gbs\": %.2f}\n",
                    algo.c_str(), n, static_cast<long long>(bytes), t * 1e6, busbw);
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_allreduce: error: %s\n", e.what());
    return 1;
  }
}
