"""PyTorch side of the multi-GPU benchmark, timed the way bench_train times tandem: data on the
GPU, drop_last, one warm-up epoch, then the median of the timed epochs.

  --paths 1gpu,dp,ddp   1gpu: eager on cuda:0; dp: nn.DataParallel over every GPU;
                        ddp: DistributedDataParallel, one process per GPU (NCCL)
  --allreduce           also NCCL allreduce bus bandwidth from 4 KB to 256 MB (2 processes)
  --cudnn-benchmark     torch.backends.cudnn.benchmark = True (every path; "+bench")

PyTorch's faster recipes, for 1gpu only, combinable (dp and ddp are skipped when one is given):
  --channels-last       model and batches in torch.channels_last ("+cl")
  --bf16                forward and loss under autocast(bfloat16), float32 weights ("+bf16")
  --cuda-graph          the whole step captured once in a CUDA graph and replayed ("graph")
  --compile             torch.compile(model), default mode ("compile"); no row if it fails
The 1gpu path is named like bench_train's: eager|graph|compile|compile+graph, then +cl+bf16+bench.

Prints one JSON object per measurement on stdout.
"""
import argparse, json, os, statistics, sys, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_lenet import capture_step, lenet, load  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


class Residual(nn.Module):
    def __init__(self, in_c, out_c, use_1x1conv=False, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_c, out_c, 3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(out_c, out_c, 3, padding=1)
        self.conv3 = nn.Conv2d(in_c, out_c, 1, stride=stride) if use_1x1conv else None
        self.bn1, self.bn2 = nn.BatchNorm2d(out_c), nn.BatchNorm2d(out_c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.conv3 is not None:
            x = self.conv3(x)
        return F.relu(y + x)


def resnet18():
    def stage(in_c, out_c, first=False):
        if first:
            return [Residual(in_c, out_c), Residual(out_c, out_c)]
        return [Residual(in_c, out_c, use_1x1conv=True, stride=2), Residual(out_c, out_c)]
    net = nn.Sequential(nn.Conv2d(1, 64, 3, 1, 1), nn.BatchNorm2d(64), nn.ReLU(),
                        *stage(64, 64, True), *stage(64, 128), *stage(128, 256), *stage(256, 512),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))
    for m in net.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    return net


def make(model):
    return lenet() if model == "lenet" else resnet18()


def lr_of(model):
    return 0.9 if model == "lenet" else 0.05


def bench_tag(args):
    return "+bench" if args.cudnn_benchmark else ""


def one_gpu_only(args):
    return args.channels_last or args.bf16 or args.cuda_graph or args.compile


def one_gpu_name(args):
    mode = "+".join(m for m, on in (("compile", args.compile), ("graph", args.cuda_graph)) if on) or "eager"
    return mode + "+cl" * args.channels_last + "+bf16" * args.bf16 + bench_tag(args)


def epoch_times(run_epoch, epochs, device):
    run_epoch()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(epochs):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run_epoch()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def emit(**kw):
    print(json.dumps(kw), flush=True)


def single_or_dp(args, model, path, x, y):
    dev = torch.device("cuda:0")
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    net = make(model).to(dev, memory_format=fmt)
    torch.cuda.reset_peak_memory_stats(dev)  # after the first allocation: before it, CUDA is not set up
    if path == "dp":
        net = nn.DataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr_of(model))  # SGD: no step count, no capturable needed
    n, bs = x.shape[0], args.batch_size
    xg, yg = x.to(dev, memory_format=fmt), y.to(dev)
    fwd = net
    name = one_gpu_name(args) if path == "1gpu" else "DataParallel" + bench_tag(args)

    def loss_of(xb, yb):  # autocast's weight cache must be off while capturing a graph
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16, cache_enabled=not args.cuda_graph):
            return F.cross_entropy(fwd(xb.contiguous(memory_format=fmt)), yb)

    def step(xb, yb):
        opt.zero_grad(set_to_none=True)
        loss_of(xb, yb).backward()
        opt.step()

    sx, sy = xg[:bs].clone(memory_format=fmt), yg[:bs].clone()  # the graph's static batch
    g = None
    try:  # torch.compile compiles here, on the first forward and backward
        if args.compile:
            fwd = torch.compile(net)
        if args.cuda_graph:
            g = capture_step(step, sx, sy, loss_of, opt)
        else:
            step(sx, sy)
    except Exception as e:
        if not args.compile:
            raise
        msg = (str(e).strip().splitlines() or [""])[0]
        print(f"torch_parallel.py: {model} {name}: torch.compile failed: {type(e).__name__}: {msg}", file=sys.stderr)
        return

    def replay(xb, yb):
        sx.copy_(xb)
        sy.copy_(yb)
        g.replay()

    train = step if g is None else replay

    def run_epoch():
        perm = torch.randperm(n, device=dev)
        for i in range(0, n - bs + 1, bs):  # drop_last, on every path
            idx = perm[i:i + bs]
            train(xg[idx], yg[idx])

    t = epoch_times(run_epoch, args.epochs, dev)
    ndev = torch.cuda.device_count() if path == "dp" else 1
    med = statistics.median(t)
    emit(framework="pytorch", model=model, path=name, devices=ndev, batch_size=bs, median_s=med,
         images_per_s=(n // bs) * bs / med, epochs_s=t, peak_mb=torch.cuda.max_memory_allocated(dev) / 2**20)


def ddp_worker(rank, world, args, model, port, q):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.backends.cudnn.benchmark = args.cudnn_benchmark  # a spawned process starts with the default
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    try:
        if model == "allreduce":
            out = []
            b = 4096
            while b <= 256 << 20:
                t = torch.rand(b // 4, device=dev)
                iters = 5 if b >= 64 << 20 else 20
                for _ in range(3):
                    dist.all_reduce(t)
                reps = []
                for _ in range(5):
                    torch.cuda.synchronize(dev)
                    dist.barrier()
                    torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        dist.all_reduce(t)
                    torch.cuda.synchronize(dev)
                    reps.append((time.perf_counter() - t0) / iters)
                med = statistics.median(reps)
                out.append(dict(kind="allreduce", framework="pytorch", algo="nccl", devices=world, bytes=b,
                                time_us=med * 1e6, busbw_gbs=b * 2 * (world - 1) / world / med / 1e9))
                b *= 4
            if rank == 0:
                q.put(out)
            return
        torch.manual_seed(0)
        x, y = load(args.data)
        if args.train_limit > 0:
            x, y = x[:args.train_limit], y[:args.train_limit]
        net = nn.parallel.DistributedDataParallel(make(model).to(dev), device_ids=[rank])
        opt = torch.optim.SGD(net.parameters(), lr=lr_of(model))
        n, bs = x.shape[0], args.batch_size
        local = bs // world
        xg, yg = x.to(dev), y.to(dev)
        g = torch.Generator(device=dev)

        def run_epoch():
            g.manual_seed(int(time.time()))  # the same order on both ranks is not needed for timing
            perm = torch.randperm(n, device=dev, generator=g)
            for i in range(0, n - bs + 1, bs):
                idx = perm[i + rank * local:i + (rank + 1) * local]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(net(xg[idx]), yg[idx]).backward()
                opt.step()

        dist.barrier()
        t = epoch_times(run_epoch, args.epochs, dev)
        if rank == 0:
            med = statistics.median(t)
            q.put([dict(framework="pytorch", model=model, path="DDP" + bench_tag(args), devices=world, batch_size=bs,
                        median_s=med, images_per_s=(n // bs) * bs / med, epochs_s=t)])
    finally:
        dist.destroy_process_group()


def run_ddp(args, model, port):
    world = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=ddp_worker, args=(r, world, args, model, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    rows = q.get()
    for p in procs:
        p.join()
    for r in rows:
        emit(**r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--models", default="lenet,resnet18")
    ap.add_argument("--paths", default="1gpu,dp,ddp")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--train-limit", type=int, default=-1)
    ap.add_argument("--allreduce", action="store_true")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True")
    ap.add_argument("--channels-last", action="store_true", help="1gpu: model and batches channels_last")
    ap.add_argument("--bf16", action="store_true", help="1gpu: forward and loss under autocast(bfloat16)")
    ap.add_argument("--cuda-graph", action="store_true", help="1gpu: the whole step in one CUDA graph")
    ap.add_argument("--compile", action="store_true", help="1gpu: torch.compile(model)")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    x, y = load(args.data)
    if args.train_limit > 0:
        x, y = x[:args.train_limit], y[:args.train_limit]
    port = 29500 + os.getpid() % 1000
    if args.allreduce and torch.cuda.device_count() >= 2:
        run_ddp(args, "allreduce", port)
        port += 1
    for model in args.models.split(","):
        for path in args.paths.split(","):
            if path == "dp" and torch.cuda.device_count() < 2:
                continue  # DDP runs on one GPU too (one process): its overhead over eager
            if path != "1gpu" and one_gpu_only(args):
                print(f"torch_parallel.py: {path} skipped: the recipe flags are for 1gpu only", file=sys.stderr)
                continue
            if path == "ddp":
                run_ddp(args, model, port)
                port += 1
            else:
                single_or_dp(args, model, path, x, y)


if __name__ == "__main__":
    main()
