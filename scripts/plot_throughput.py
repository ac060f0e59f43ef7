#!/usr/bin/env python3
"""Draws one model's training throughput from a bench JSON-lines file (bench/perf_gpu.sh's
perf.jsonl) as a horizontal bar chart: images/s per variant, tandem and PyTorch in two colours,
peak device memory written at the end of each bar.

  python3 scripts/plot_throughput.py bench/results/perf_h200_2026-12-01.jsonl --model resnet18 \
      --title "ResNet-18, one H200" --out docs/img/resnet18_throughput.png

Needs matplotlib (Debian: python3-matplotlib). Exit 2 on bad arguments, 1 on a file that cannot
be read or holds no result for the model.
"""
import argparse
import json
import sys

COLOURS = {"tandem": "#1f77b4", "pytorch": "#d62728"}


def read_results(path, model):
    """(framework, path, images/s, peak MB) of every result line for `model`, in file order."""
    try:
        with open(path) as f:
            lines = [json.loads(l) for l in f if l.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeError(f"{path}: {e}")
    rows = [(r["framework"], r["path"], r["images_per_s"], r.get("peak_mb"))
            for r in lines if r.get("model") == model and "images_per_s" in r]
    if not rows:
        raise RuntimeError(f"{path}: no result for model {model}")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--model", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        rows = read_results(args.jsonl, args.model)
    except RuntimeError as e:
        print(f"plot_throughput: {e}", file=sys.stderr)
        return 1
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.38 * len(rows) + 1.2))
    labels = [f"{fw}  {path}" for fw, path, _, _ in rows]
    ys = range(len(rows))[::-1]
    ax.barh(list(ys), [r[2] / 1000 for r in rows], color=[COLOURS.get(r[0], "gray") for r in rows])
    for y, (_, _, ips, mb) in zip(ys, rows):
        ax.text(ips / 1000, y, f" {ips / 1000:.1f}k" + (f"  ({mb:.0f} MB)" if mb else ""), va="center", fontsize=8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("images / s (thousands); peak device memory in parentheses")
    ax.set_xlim(0, max(r[2] for r in rows) / 1000 * 1.3)
    ax.set_title(args.title or args.model)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
