"""PyTorch side of the LeNet benchmark: the same recipe as tandem's (d2l LeNet, sigmoid +
average pooling, xavier-uniform init, SGD lr 0.9, batch 256) timed the same way (one warm-up
epoch, then the median of the timed epochs, synchronized with CUDA events).

Paths:
  eager       the whole dataset on the GPU, batches gathered there with a shuffled index
  dataloader  torch.utils.data.DataLoader over CPU tensors, each batch copied to the GPU
  graph       eager's step captured once in a CUDA graph and replayed

Prints one JSON object per path on stdout.
"""
import argparse, gzip, json, os, statistics, struct, sys, time

import numpy as np
import torch
from torch import nn


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data_dir, train=True):
    prefix = "train" if train else "t10k"
    x = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
    x = torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)
    return x, torch.from_numpy(y.astype(np.int64))


def lenet():
    net = nn.Sequential(
        nn.Conv2d(1, 6, kernel_size=5, padding=2), nn.Sigmoid(), nn.AvgPool2d(2, 2),
        nn.Conv2d(6, 16, kernel_size=5), nn.Sigmoid(), nn.AvgPool2d(2, 2),
        nn.Flatten(), nn.Linear(400, 120), nn.Sigmoid(), nn.Linear(120, 84), nn.Sigmoid(),
        nn.Linear(84, 10))
    for m in net:
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    return net


def capture_step(step, sx, sy, loss_of, opt):
    """PyTorch's whole-network capture (torch.cuda.graphs docs): three warm-up steps on a side
    stream, then forward, loss, backward and opt.step() on the static batch (sx, sy) captured in
    a CUDAGraph, which is returned; each replay trains on whatever was copied into sx, sy."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step(sx, sy)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # backward in the graph allocates the grads it then overwrites
    with torch.cuda.graph(g):
        loss_of(sx, sy).backward()
        opt.step()
    return g


def time_epochs(run_epoch, epochs):
    run_epoch()  # warm-up: cuDNN autotuning, allocator growth, module load
    torch.cuda.synchronize()
    times = []
    for _ in range(epochs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_epoch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--paths", default="eager,dataloader,graph")
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    x_cpu, y_cpu = load(args.data)
    n, bs = x_cpu.shape[0], args.batch_size
    x_gpu, y_gpu = x_cpu.to(dev), y_cpu.to(dev)
    loss_fn = nn.CrossEntropyLoss()

    for path in args.paths.split(","):
        torch.cuda.reset_peak_memory_stats(dev)
        net = lenet().to(dev)
        opt = torch.optim.SGD(net.parameters(), lr=0.9)

        def step(xb, yb):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(xb), yb)
            loss.backward()
            opt.step()
            return loss

        if path == "eager":
            def run_epoch():
                perm = torch.randperm(n, device=dev)
                for i in range(0, n - bs + 1, bs):  # drop_last, like the tandem benchmark
                    idx = perm[i:i + bs]
                    step(x_gpu[idx], y_gpu[idx])
        elif path == "dataloader":
            ds = torch.utils.data.TensorDataset(x_cpu, y_cpu)
            dl = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, drop_last=True)

            def run_epoch():
                for xb, yb in dl:
                    step(xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True))
        elif path == "graph":
            sx = torch.empty(bs, 1, 28, 28, device=dev)
            sy = torch.zeros(bs, dtype=torch.long, device=dev)
            g = capture_step(step, sx, sy, lambda xb, yb: loss_fn(net(xb), yb), opt)

            def run_epoch():
                perm = torch.randperm(n, device=dev)
                for i in range(0, n - bs + 1, bs):
                    idx = perm[i:i + bs]
                    sx.copy_(x_gpu[idx])
                    sy.copy_(y_gpu[idx])
                    g.replay()
        else:
            sys.exit(f"unknown path {path}")
        times = time_epochs(run_epoch, args.epochs)
        print(json.dumps({"framework": "pytorch", "path": path, "model": "lenet",
                          "devices": 1, "batch_size": bs,
                          "median_s": statistics.median(times), "epochs_s": times,
                          "images_per_s": (n // bs) * bs / statistics.median(times),
                          "peak_mb": torch.cuda.max_memory_allocated(dev) / 2**20,
                          "version": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
