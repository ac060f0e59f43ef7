#!/usr/bin/env python3
"""Bytes per rank against the number of ranks, per ZeRO stage, from bench/zero_memory.sh's output.

    /usr/bin/python3 scripts/plot_zero_memory.py bench/results/zero_memory_cpu_2026-12-02.txt docs/img/zero_memory.png

Points: the memory line of each --zero run (params + shard + grads + optimizer state of rank 0).
Lines: the formulas for fp32 Adam in tandem's accounting, Ψ from the runs' DDP figures:
DDP 16Ψ; stage 1 8Ψ + 12Ψ/N (params and grads whole; the shard copy and its two moments);
stage 2 4Ψ + 16Ψ/N; stage 3 (FSDP at rest) 16Ψ/N. Prints the table it drew.
"""
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LINE = re.compile(
    r"N (\d+)\s+mode (\w+)\s+max_rss_kb (\d+)\s+wall_s ([\d.]+)(?:\s+memory of rank \d+ of \d+ \([^)]*\), bytes: "
    r"params (\d+) \+ shard (\d+), grads (\d+), optimizer state (\d+), total (\d+); DDP: params (\d+), grads (\d+), "
    r"optimizer state (\d+), total (\d+))?")


def read(path):
    runs = []
    for text in open(path):
        m = LINE.match(text)
        if not m:
            continue
        g = m.groups()
        run = {"n": int(g[0]), "mode": g[1], "rss_kb": int(g[2]), "wall_s": float(g[3])}
        if g[4] is not None:
            keys = ["params", "shard", "grads", "state", "total", "ddp_params", "ddp_grads", "ddp_state", "ddp_total"]
            run.update({k: int(v) for k, v in zip(keys, g[4:])})
        runs.append(run)
    return runs


def formula(mode, psi, n):
    return {"ddp": 16 * psi, "zero1": 8 * psi + 12 * psi / n, "zero2": 4 * psi + 16 * psi / n,
            "zero3": 16 * psi / n}[mode]


def main():
    src, dst = sys.argv[1], sys.argv[2]
    runs = read(src)
    zero = [r for r in runs if "total" in r]
    if not zero:
        sys.exit(f"{src}: no memory lines")
    psi = zero[0]["ddp_params"] / 4
    ns = sorted({r["n"] for r in runs})
    mib = 1024.0 * 1024.0
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {"ddp": ("DDP (16Ψ on every N)", "black"), "zero1": ("ZeRO-1", "tab:blue"), "zero2": ("ZeRO-2", "tab:orange"),
              "zero3": ("ZeRO-3 (FSDP, at rest)", "tab:green")}
    fine = [1 + i * (max(ns) - 1) / 100 for i in range(101)]
    for mode, (label, color) in styles.items():
        ax.plot(fine, [formula(mode, psi, n) / mib for n in fine], "--", color=color, linewidth=1)
        if mode == "ddp":
            pts = [(r["n"], r["ddp_total"]) for r in zero if r["mode"] == "zero1"]
        else:
            pts = [(r["n"], r["total"]) for r in zero if r["mode"] == mode]
        pts.sort()
        if pts:
            ax.plot([p[0] for p in pts], [p[1] / mib for p in pts], "o", color=color, label=label)
    ax.set_xlabel("processes N")
    ax.set_ylabel("MiB per rank (params + grads + optimizer state)")
    ax.set_xticks(ns)
    ax.set_ylim(bottom=0)
    ax.set_title(f"ResNet-18, Adam, fp32 (Ψ = {psi / 1e6:.2f} M): measured (points), formulas (dashed)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)
    print("| N | mode | params + shard | grads | optimizer state | total | formula | max RSS (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(runs, key=lambda r: (r["n"], r["mode"])):
        if "total" in r:
            print(f"| {r['n']} | {r['mode']} | {r['params']} + {r['shard']} | {r['grads']} | {r['state']} | {r['total']} "
                  f"| {formula(r['mode'], psi, r['n']):.0f} | {r['rss_kb'] / 1024:.0f} |")
        else:
            print(f"| {r['n']} | {r['mode']} | | | | | {formula(r['mode'], psi, r['n']):.0f} | {r['rss_kb'] / 1024:.0f} |")


if __name__ == "__main__":
    main()
