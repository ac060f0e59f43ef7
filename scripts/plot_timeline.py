"""Draws one replayed training step of each framework as a row of GPU kernels, from the median
replays that bench/timeline_summary.py --json wrote (node offsets and durations):

  python3 scripts/plot_timeline.py OUT.png A.json [B.json ...] [--title TEXT]

Each row is one graph replay on the same time axis; each box one node, coloured by what it is
(convolution, matrix product, elementwise/per-channel pass, memory), so where the step's time
goes and how much of it is spent between nodes can be read off directly.
"""
import argparse, json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

KINDS = [  # (label, colour, substrings of kernel names), first match wins
    ("convolution", "#d62728", ("conv", "fprop", "dgrad", "wgrad", "fft", "flip_filter", "nchwToNhwc", "nhwcToNchw")),
    ("matrix product", "#1f77b4", ("gemm", "gemv", "splitK")),
    ("pooling", "#9467bd", ("pool",)),
    ("memset / memcpy", "#7f7f7f", ("memset", "memcpy")),
    ("elementwise, loss, optimizer", "#2ca02c", ("",)),
]


def kind(name):
    for label, colour, keys in KINDS:
        if any(k in name for k in keys):
            return label, colour
    return KINDS[-1][0], KINDS[-1][1]


def main():
    ap = argparse.ArgumentParser(description="One replayed step per summary, on one time axis.")
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--title", default="One replayed training step")
    args = ap.parse_args()
    out, inputs = args.out, args.inputs
    steps = []
    for p in inputs:
        with open(p) as f:
            steps.append(json.load(f))
    fig, ax = plt.subplots(figsize=(11, 1.1 + 0.7 * len(steps)))
    for row, step in enumerate(steps):
        for n in step["nodes"]:
            _, colour = kind(n["name"])
            ax.broken_barh([(n["offset"], max(n["dur"], 0.3))], (row - 0.35, 0.7), facecolors=colour,
                           edgecolors="white", linewidth=0.3)
        ax.text(step["span_us"] + 4, row, f"{step['span_us']:.0f} µs (period {step['period_us']:.0f})",
                va="center", fontsize=8)
    ax.set_yticks(range(len(steps)))
    ax.set_yticklabels([s["label"] or p for s, p in zip(steps, inputs)])
    ax.invert_yaxis()
    ax.set_xlabel("µs from the first node of a replay (median of the replays)")
    ax.set_xlim(0, max(s["span_us"] for s in steps) * 1.22)
    ax.legend(handles=[Patch(color=c, label=l) for l, c, _ in KINDS], fontsize=7, ncol=5, loc="upper center",
              bbox_to_anchor=(0.5, -0.38 if len(steps) < 3 else -0.25), frameon=False)
    ax.set_title(f"{args.title}: the GPU's kernels in order", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


if __name__ == "__main__":
    main()
