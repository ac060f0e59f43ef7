"""Draws a timeline written by --trace (Chrome trace JSON) as a PNG: one row per device and
stream, one bar per span, the steps after the first (warm-up) one.

  python3 bench/plot_trace.py step.json step.png [--skip-first] [--title TEXT]

A multi-process trace (every rank's events merged by rank 0) draws one row per rank and track.
"""
import json, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# By the span name's first word: the in-process steppers record "forward+backward", the
# multi-process one "forward" and "backward"; collectives are "allreduce #k", "broadcast #k".
COLORS = {"forward+backward": "#4C72B0", "forward": "#8FAADC", "backward": "#4C72B0",
          "allreduce": "#C44E52", "broadcast": "#DD8452", "optimizer": "#55A868"}


def color_of(name):
    return COLORS.get(name.split(" ")[0], "#C44E52")


def main():
    src, dst = sys.argv[1], sys.argv[2]
    skip_first = "--skip-first" in sys.argv
    doc = json.load(open(src))
    events = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    if skip_first:  # the first step includes one-time work (algorithm choice, pool growth)
        cut = min((e["ts"] + e["dur"] for e in spans if e["name"] == "optimizer"), default=0)
        spans = [e for e in spans if e["ts"] > cut]
    t0 = min(e["ts"] for e in spans)
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(rows) + 1.2))
    for y, key in enumerate(rows):
        for e in spans:
            if (e["pid"], e["tid"]) != key:
                continue
            color = color_of(e["name"])
            ax.barh(y, e["dur"] / 1000, left=(e["ts"] - t0) / 1000, color=color, edgecolor="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{procs.get(p, p)} {threads.get((p, t), t)}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    kinds = [k for k in COLORS if any(e["name"].split(" ")[0] == k for e in spans)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds]
    ax.legend(handles, kinds, loc="lower right", fontsize=8)
    title = sys.argv[sys.argv.index("--title") + 1] if "--title" in sys.argv else src.split("/")[-1]
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main()
