"""Draws a timeline written by --trace (Chrome trace JSON) as a PNG: one row per device and
stream, one bar per span, the steps after the first (warm-up) one.

  python3 bench/plot_trace.py step.json step.png [--skip-first]
"""
import json, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"forward+backward": "#4C72B0", "optimizer": "#55A868"}


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
            color = COLORS.get(e["name"], "#C44E52")
            ax.barh(y, e["dur"] / 1000, left=(e["ts"] - t0) / 1000, color=color, edgecolor="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{procs.get(p, p)} {threads.get((p, t), t)}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ["#4C72B0", "#C44E52", "#55A868"]]
    ax.legend(handles, ["forward+backward", "allreduce", "optimizer"], loc="lower right", fontsize=8)
    ax.set_title(src.split("/")[-1])
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main()
