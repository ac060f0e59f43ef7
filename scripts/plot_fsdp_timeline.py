#!/usr/bin/env python3
"""Draws one FSDP FULL_SHARD training step from a merged multi-process trace (docs/12-sharding.md):

    python3 scripts/plot_fsdp_timeline.py TRACE.json OUT.png [--title TEXT]

TRACE.json is what the test worker writes with
    tandem-run --nproc-per-node 2 tandem_dist_worker fsdp-full --trace TRACE.json ...
(FullyShardedDataParallel::set_trace): per rank, "forward u", "backward u", "free u" and
"optimizer" spans on the compute track, "gather u" and "reduce-scatter u" on the comm track, from
issue to wait. Each rank gets a compute row, then all-gather and reduce-scatter rows, one per
collective in flight at once (a prefetched all-gather is issued while the one before it still
runs; Gloo runs one collective at a time, so a span includes its wait in the queue). A free is a
tick on the compute row. The last traced step is drawn (the steps are cut at the
optimizer spans).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLORS = {"forward": "#8FAADC", "backward": "#4C72B0", "optimizer": "#55A868",
          "gather": "#DD8452", "reduce-scatter": "#C44E52", "free": "#000000"}
LANES = {"forward": 0, "backward": 0, "optimizer": 0, "free": 0, "gather": 1, "reduce-scatter": 2}
LANE_NAMES = ["compute", "all-gather", "reduce-scatter"]


def kind_of(name):
    return name.rsplit(" ", 1)[0] if name[-1].isdigit() else name


def last_step(spans):
    """The spans of each rank after its second-to-last optimizer span."""
    out = []
    for pid in sorted({e["pid"] for e in spans}):
        mine = sorted((e for e in spans if e["pid"] == pid), key=lambda e: e["ts"])
        opt_ends = [e["ts"] + e["dur"] for e in mine if e["name"] == "optimizer"]
        cut = opt_ends[-2] if len(opt_ends) >= 2 else float("-inf")
        out += [e for e in mine if e["ts"] >= cut]
    return out


def main():
    ap = argparse.ArgumentParser(description="One FSDP step: compute, all-gathers, reduce-scatters per rank.")
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--title", default="FSDP FULL_SHARD, one step on two processes")
    args = ap.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = last_step([e for e in events if e.get("ph") == "X"])
    t0 = min(e["ts"] for e in spans)
    # Rows: per rank, compute, then as many all-gather and reduce-scatter rows as were in flight
    # at once (each collective on the first row free at its start).
    placed, rows = [], []
    for p in sorted({e["pid"] for e in spans}):
        for lane in range(3):
            sub_ends = []
            mine = sorted((e for e in spans if e["pid"] == p and LANES.get(kind_of(e["name"]), 0) == lane),
                          key=lambda e: e["ts"])
            for e in mine:
                k = 0 if lane == 0 else next((i for i, end in enumerate(sub_ends) if end <= e["ts"]), len(sub_ends))
                if lane and k == len(sub_ends):
                    sub_ends.append(0)
                if lane:
                    sub_ends[k] = e["ts"] + e["dur"]
                placed.append((e, len(rows) + k))
            label = f"{procs.get(p, p)} {LANE_NAMES[lane]}"
            rows += [label] + [""] * (max(len(sub_ends), 1) - 1)
    fig, ax = plt.subplots(figsize=(13, 0.32 * len(rows) + 1.8))
    for e, y in placed:
        kind = kind_of(e["name"])
        left, width = (e["ts"] - t0) / 1000, e["dur"] / 1000
        if kind == "free":
            ax.plot([left, left], [y - 0.45, y + 0.45], color=COLORS["free"], linewidth=1)
            continue
        ax.barh(y, width, left=left, height=0.8, color=COLORS.get(kind, "#999999"), edgecolor="white",
                linewidth=0.5)
        unit = e["name"].rsplit(" ", 1)[-1]
        if unit.isdigit() and width > 0.3:
            ax.text(left + width / 2, y, unit, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds (host clock; a number is the unit)")
    ax.set_title(args.title)
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(handles),
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}: {len(spans)} spans, {len(rows)} rows")


if __name__ == "__main__":
    main()
