"""Draws replayed steps from bench/timeline_summary.py's --json output as a PNG: one panel per
summary, one bar per node at its offset in the median replay. Nodes that overlap in time (the
branches of a graph with work on two streams) go to separate lanes, each on the first lane free
at its start, so concurrency shows as a second row.

  python3 bench/plot_replay.py OUT.png SUMMARY.json[=LABEL] [SUMMARY.json[=LABEL] ...]
"""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# By what the kernel's name says it does.
KINDS = [("wgrad", "weight gradient", "#C44E52"), ("linear_pass", "linear layer", "#4C72B0"),
         ("row_conv", "convolution (tandem)", "#8172B2"), ("direct_conv", "convolution (tandem)", "#8172B2"),
         ("xmma", "convolution (cuDNN)", "#DD8452"), ("pool", "activation + pooling", "#55A868"),
         ("memcpy", "copy / fill", "#999999"), ("memset", "copy / fill", "#999999"),
         ("Fill", "copy / fill", "#999999")]


def kind_of(name):
    for key, label, color in KINDS:
        if key in name:
            return label, color
    return "other (loss, optimizer, sums, gathers)", "#CCB974"


def lanes(nodes):
    """Lane index per node: the first lane whose last bar ends before the node starts."""
    ends, out = [], []
    for n in nodes:
        start, end = n["offset"], n["offset"] + n["dur"]
        for i, e in enumerate(ends):
            if e <= start + 0.05:
                ends[i] = end
                out.append(i)
                break
        else:
            ends.append(end)
            out.append(len(ends) - 1)
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    dst, specs = sys.argv[1], sys.argv[2:]
    panels = []
    for spec in specs:
        path, _, label = spec.partition("=")
        doc = json.load(open(path))
        nodes = sorted(doc["nodes"], key=lambda n: n["offset"])
        panels.append((label or doc.get("label", path), doc, nodes, lanes(nodes)))
    span = max(max(n["offset"] + n["dur"] for n in nodes) for _, _, nodes, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.3 + 1.1 * len(panels)), sharex=True, squeeze=False)
    seen = {}
    for ax, (label, doc, nodes, lane) in zip(axes[:, 0], panels):
        for n, l in zip(nodes, lane):
            kind, color = kind_of(n["name"])
            bar = ax.barh(l, n["dur"], left=n["offset"], height=0.8, color=color, edgecolor="white", linewidth=0.5)
            seen.setdefault(kind, bar)
        ax.set_yticks(range(max(lane) + 1))
        ax.set_yticklabels([f"lane {i + 1}" for i in range(max(lane) + 1)])
        ax.invert_yaxis()
        ax.set_title(f"{label}: {len(nodes)} nodes, {doc['span_us']:.0f} µs from first start to last end, "
                     f"period {doc['period_us']:.0f} µs", fontsize=9, loc="left")
        ax.set_xlim(0, span * 1.01)
    axes[-1, 0].set_xlabel("µs from the replay's first node")
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08 + 0.02 * (3 - len(panels)), 1, 1))
    fig.savefig(dst, dpi=130)


if __name__ == "__main__":
    main()
