"""PyTorch interop, both ways, through safetensors files.

(a) tandem writes a LeNet checkpoint and its logits on a fixed input; PyTorch loads the
    checkpoint into its own LeNet of the same shape and must produce the same logits.
(b) PyTorch writes a checkpoint with safetensors.torch.save_file; tandem loads it and must
    produce PyTorch's logits, and tandem's re-save of it must load back into PyTorch bit for bit.
    When Fashion-MNIST is installed, the PyTorch model is first trained briefly and both sides
    must reach the same accuracy (within 0.001) on the first 1000 test images.

Usage: lenet_interop.py TANDEM_TESTS [--data DIR] [--keep]
Exit code 77 (a skip for ctest) when torch or safetensors cannot be imported.
"""
import argparse, os, shutil, subprocess, sys, tempfile

try:
    import numpy as np
    import torch
    from torch import nn
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"skipped: {e} (install python3-torch, python3-numpy and pip's safetensors)")
    sys.exit(77)

# d2l's LeNet and the IDX reader of the benchmarks: the same model tandem's nn::models::lenet builds.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import torch_lenet  # noqa: E402

LOGIT_TOL = 1e-5


def fashion_mnist(data_dir, train, limit):
    x, y = torch_lenet.load(data_dir, train)
    return x[:limit], y[:limit]


def have_data(data_dir):
    return all(os.path.isfile(os.path.join(data_dir, f"{p}-{k}-idx{n}-ubyte.gz"))
               for p in ("train", "t10k") for k, n in (("images", 3), ("labels", 1)))


def run_tandem(tandem_tests, tag, workdir, data_dir=None):
    env = dict(os.environ, TANDEM_INTEROP_DIR=workdir)
    env.pop("TANDEM_INTEROP_DATA", None)
    if data_dir:
        env["TANDEM_INTEROP_DATA"] = data_dir
    r = subprocess.run([tandem_tests, tag], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stdout.write(r.stdout + r.stderr)
        raise SystemExit(f"FAIL: tandem_tests {tag} exited with {r.returncode}")


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        raise SystemExit(1)


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def tandem_to_torch(tandem_tests, workdir):
    run_tandem(tandem_tests, "[interop-export]", workdir)
    path = os.path.join(workdir, "tandem_lenet.safetensors")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    check(meta.get("format") == "pt" and meta.get("model") == "lenet"
          and meta.get("tandem.checksum", "").startswith("crc32:"),
          f"(a) tandem's metadata reads in safetensors: {meta}")
    net = torch_lenet.lenet().eval()
    net.load_state_dict(load_file(path), strict=True)  # names, shapes and dtypes must match
    print("ok   (a) tandem's checkpoint loads into PyTorch's LeNet (strict)")
    io = load_file(os.path.join(workdir, "tandem_io.safetensors"))
    with torch.no_grad():
        logits = net(io["input"])
    d = max_diff(logits, io["logits"])
    check(d < LOGIT_TOL, f"(a) PyTorch's logits equal tandem's: max abs diff {d:.2e} "
                         f"(|logits| up to {io['logits'].abs().max().item():.2f})")


def train_briefly(net, data_dir, steps=100, batch=128):
    x, y = fashion_mnist(data_dir, True, steps * batch)
    opt = torch.optim.Adam(net.parameters(), lr=5e-3)
    loss_fn = nn.CrossEntropyLoss()
    net.train()
    for i in range(steps):
        xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
        opt.zero_grad()
        loss_fn(net(xb), yb).backward()
        opt.step()
    net.eval()


def accuracy(net, x, y):
    with torch.no_grad():
        return (net(x).argmax(1) == y).double().mean().item()


def torch_to_tandem(tandem_tests, workdir, data_dir):
    torch.manual_seed(0)
    net = torch_lenet.lenet()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    if data_dir:
        train_briefly(net, data_dir)
    net.eval()
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    save_file(state, os.path.join(workdir, "torch_lenet.safetensors"))
    x = torch.rand(16, 1, 28, 28)
    save_file({"input": x}, os.path.join(workdir, "torch_io.safetensors"))

    run_tandem(tandem_tests, "[interop-eval]", workdir, data_dir)
    print("ok   (b) PyTorch's checkpoint loads into tandem's LeNet")
    out = load_file(os.path.join(workdir, "tandem_eval.safetensors"))
    with torch.no_grad():
        logits = net(x)
    d = max_diff(logits, out["logits"])
    check(d < LOGIT_TOL, f"(b) tandem's logits equal PyTorch's: max abs diff {d:.2e}")

    resaved = load_file(os.path.join(workdir, "tandem_resaved.safetensors"))
    check(sorted(resaved) == sorted(state),
          "(b) tandem's re-save has PyTorch's names")
    check(all(torch.equal(resaved[k], state[k]) and resaved[k].dtype == state[k].dtype
              for k in state), "(b) tandem's re-save holds PyTorch's tensors bit for bit")

    if not data_dir:
        print("skip accuracy: Fashion-MNIST is not installed")
        return
    tx, ty = fashion_mnist(data_dir, False, 1000)
    check(torch.equal(out["labels"], ty), "(b) both sides read the same 1000 test labels")
    acc_torch = accuracy(net, tx, ty)
    acc_tandem = (out["predictions"] == ty).double().mean().item()
    check(abs(acc_torch - acc_tandem) <= 0.001 + 1e-12,
          f"(b) test accuracy on 1000 images: PyTorch {acc_torch:.3f}, tandem {acc_tandem:.3f}")
    back = torch_lenet.lenet().eval()
    back.load_state_dict(resaved, strict=True)
    acc_back = accuracy(back, tx, ty)
    check(abs(acc_back - acc_tandem) <= 0.001 + 1e-12,
          f"(a) tandem's checkpoint in PyTorch: accuracy {acc_back:.3f} (tandem {acc_tandem:.3f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tandem_tests")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--keep", action="store_true", help="keep the exchange folder")
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}")
    torch.set_num_threads(1)  # ctest runs tests side by side: OpenMP threads would fight
    data_dir = args.data if have_data(args.data) else None
    workdir = tempfile.mkdtemp(prefix="tandem_interop_")
    ok = False
    try:
        tandem_to_torch(args.tandem_tests, workdir)
        torch_to_tandem(args.tandem_tests, workdir, data_dir)
        ok = True
    finally:
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"files kept in {workdir}")


if __name__ == "__main__":
    main()
