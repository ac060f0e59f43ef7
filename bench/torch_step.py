"""PyTorch side of bench_step: the same step split (host enqueue time, wall time, forward,
forward+backward) for ResNet-18 or LeNet on random data on one GPU, one JSON line per setting.

  --cudnn-benchmark 0,1   settings of torch.backends.cudnn.benchmark to run
  --kernels FILE          also write the profiler's per-kernel GPU time table of one step
"""
import argparse, json, os, statistics, sys, time

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_parallel import make, lr_of  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cudnn-benchmark", default="0,1")
    ap.add_argument("--kernels", default="")
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    for bench in [int(b) for b in args.cudnn_benchmark.split(",")]:
        torch.backends.cudnn.benchmark = bool(bench)
        torch.manual_seed(0)
        net = make(args.model).to(dev)
        opt = torch.optim.SGD(net.parameters(), lr=lr_of(args.model))
        x = torch.randn(args.batch_size, 1, 28, 28, device=dev)
        y = (torch.arange(args.batch_size, device=dev) * 7) % 10

        def run(phase):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x), y)
            if phase >= 1:
                loss.backward()
            if phase >= 2:
                opt.step()

        for _ in range(5):
            run(2)
        torch.cuda.synchronize(dev)
        host, wall, fwd, fwd_bwd = [], [], [], []
        for _ in range(args.reps):
            for _ in range(args.steps):
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                run(2)
                host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                run(2)
            torch.cuda.synchronize(dev)
            wall.append((time.perf_counter() - t0) * 1e3 / args.steps)
            for phase, out in ((0, fwd), (1, fwd_bwd)):
                t1 = time.perf_counter()
                for _ in range(args.steps):
                    run(phase)
                torch.cuda.synchronize(dev)
                out.append((time.perf_counter() - t1) * 1e3 / args.steps)
        med = statistics.median
        print(json.dumps(dict(framework="pytorch", kind="step", model=args.model, batch_size=args.batch_size,
                              cudnn_benchmark=bench, host_ms=med(host), wall_ms=med(wall), fwd_ms=med(fwd),
                              fwd_bwd_ms=med(fwd_bwd), images_per_s=1e3 * args.batch_size / med(wall))),
              flush=True)
        if args.kernels:
            from torch.profiler import profile, ProfilerActivity
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(4):
                    run(2)
                torch.cuda.synchronize(dev)
            with open(f"{args.kernels}.bench{bench}.txt", "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60,
                                                  max_name_column_width=90))


if __name__ == "__main__":
    main()
