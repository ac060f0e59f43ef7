// Allreduce bus bandwidth through tandem's process group, one process per device: run it under
// a launcher (tandem-run --nproc-per-node 2 bench_pg_allreduce). 4 KB to 256 MB of float32 on
// this rank's GPU over NCCL (or, with --device cpu, the CPU over Gloo, up to 16 MB); rank 0
// prints one JSON line per size, timed as bench_allreduce.cpp times the in-process
// communicators (median over repetitions of back-to-back calls; bus bandwidth =
// bytes * 2(n-1)/n / time, as nccl-tests and bench/torch_parallel.py --allreduce).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "parallel/distributed/process_group.h"

using namespace tandem;
using namespace tandem::parallel::distributed;

int main(int argc, char** argv) {
  try {
    const bool cpu = argc > 2 && std::strcmp(argv[1], "--device") == 0 && std::strcmp(argv[2], "cpu") == 0;
    const DistEnv env = read_dist_env();
    const Device device = cpu ? kCPU : Device::cuda(env.local_rank);
    DistributedContext ctx = init_process_group(cpu ? "gloo" : "nccl", device);
    ProcessGroup& pg = *ctx.group;
    const int n = pg.size();
    const int64_t largest = cpu ? (int64_t(16) << 20) : (int64_t(256) << 20);
    for (int64_t bytes = 4096; bytes <= largest; bytes *= 4) {
      Tensor buf = rand({bytes / 4}, kFloat32, device);
      const int iters = bytes >= (int64_t(64) << 20) ? 5 : 20;
      for (int w = 0; w < 3; ++w) pg.allreduce(buf)->wait();
      std::vector<double> times;
      for (int rep = 0; rep < 5; ++rep) {
        pg.barrier();
        synchronize(device);
        const auto t0 = std::chrono::steady_clock::now();
        WorkPtr last;
        for (int i = 0; i < iters; ++i) (last = pg.allreduce(buf))->wait();
        last->synchronize();
        times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
      }
      std::sort(times.begin(), times.end());
      const double t = times[times.size() / 2];
      const double busbw = static_cast<double>(bytes) * 2.0 * (n - 1) / n / t / 1e9;
      if (pg.rank() == 0) {
        std::printf("{\"kind\": \"allreduce\", \"framework\": \"tandem\", \"algo\": \"pg-%s\", \"devices\": %d, "
                    "\"bytes\": %lld, \"time_us\": %.2f, \"busbw_gbs\": %.2f}\n",
                    pg.backend().c_str(), n, static_cast<long long>(bytes), t * 1e6, busbw);
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pg_allreduce: error: %s\n", e.what());
    return 1;
  }
}
