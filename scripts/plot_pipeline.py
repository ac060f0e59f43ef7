#!/usr/bin/env python3
"""Draws the pipeline chapter's measured pictures (docs/11-pipelines.md) from bench/pipeline_cpu.py's output.

  pipeline_timelines.png  GPipe and 1F1B side by side, one step (the shortest traced) of P = 4
                          stages and M = 8 micro-batches as the timelines of real runs recorded it (one lane per
                          stage process, one box per forward F or backward B)
  pipeline_bubble.png     the idle fraction per stage against M, measured (the mean over the
                          stages, the range between the least and the most idle stage) and the
                          formula (P - 1)/(M + P - 1), for P = 2 and P = 4

  /usr/bin/python3 scripts/plot_pipeline.py [--results FILE] [--traces DIR] [--out-dir docs/img]

Needs matplotlib (Debian: python3-matplotlib). Exit 2 on bad arguments or missing inputs.
"""
import argparse
import json
import os
import re
import sys

STAGE_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]  # stage 0..3, as ranks 0..3 elsewhere
HERE = os.path.dirname(os.path.abspath(__file__))


def one_step(path, m):
    """{stage pid: [(start ms, duration ms, name)]} of the shortest traced step (each stage's 2M
    actions; the first traced step skipped), the times from that step's first start: on a
    shared machine the others include a process that was descheduled for a while."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    stages = {}
    for e in events:
        stages.setdefault(e["pid"], []).append(e)
    for spans in stages.values():
        spans.sort(key=lambda e: e["ts"])
    best = None
    for k in range(1, min(len(v) for v in stages.values()) // (2 * m)):
        step = {s: v[k * 2 * m:(k + 1) * 2 * m] for s, v in stages.items()}
        t0 = min(v[0]["ts"] for v in step.values())
        t1 = max(v[-1]["ts"] + v[-1]["dur"] for v in step.values())
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, t0, step)
    _, t0, step = best
    return {s: [((e["ts"] - t0) / 1000, e["dur"] / 1000, e["name"]) for e in v] for s, v in step.items()}


def plot_timelines(path, plt, traces, m=8):
    fig, axes = plt.subplots(1, 2, figsize=(13.5, 3.9), sharey=True)
    steps = {s: one_step(os.path.join(traces, f"pipeline_{s}_p4_m8.json"), m) for s in ("gpipe", "1f1b")}
    end = max(t + d for step in steps.values() for v in step.values() for t, d, _ in v)  # one time scale
    for ax, schedule in zip(axes, ["gpipe", "1f1b"]):
        step = steps[schedule]
        for lane, s in enumerate(sorted(step)):
            y = len(step) - 1 - lane
            for t, d, name in step[s]:
                backward = name.startswith("B")
                ax.barh(y, d, left=t, height=0.72, color=STAGE_COLOURS[lane % 4], alpha=1.0 if backward else 0.55,
                        edgecolor="white", linewidth=0.6)
                if d > end / 60:
                    ax.text(t + d / 2, y, name, ha="center", va="center", fontsize=6.5,
                            color="white" if backward else "black")
        ax.set_yticks(range(len(step)))
        ax.set_yticklabels([f"stage {s}" for s in reversed(range(len(step)))], fontsize=9)
        ax.set_xlabel("ms from the step's first action", fontsize=9)
        ax.set_xlim(0, end * 1.01)
        ax.set_title(("GPipe: every forward, then every backward" if schedule == "gpipe" else
                      "1F1B: warm-up forwards, then one forward one backward"), fontsize=10.5, loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle("One step of a 4-stage pipeline over 4 CPU processes (Gloo), 8 micro-batches: "
                 "F pale, B dark, white = idle (a 2-core machine, 2026-12-02)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def read_idle(results):
    """{P: {schedule: [(M, [idle per stage])]}} from the step-time tables of the results file."""
    out, p = {}, None
    for line in open(results):
        head = re.match(r"## P = (\d+): step time", line)
        if head:
            p = int(head[1])
            out[p] = {}
            continue
        if line.startswith("## "):
            p = None
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if p and len(cells) > 4 and cells[0] in ("gpipe", "1f1b"):
            out[p].setdefault(cells[0], []).append((int(cells[1]), [float(c) for c in cells[3:-1]]))
    return out


def plot_bubble(path, plt, results):
    data = read_idle(results)
    cores = re.search(r"(\d+) CPU cores", open(results).read())
    cores = int(cores[1]) if cores else None
    if not data:
        sys.exit(f"plot_pipeline: no step-time tables in {results}")
    fig, axes = plt.subplots(1, len(data), figsize=(11.5, 4.0), sharey=True)
    for ax, p in zip(axes, sorted(data)):
        ms = [1 + i * 0.25 for i in range(61)]
        ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], color="black", linewidth=1.2,
                label="(P − 1)/(M + P − 1)")
        if cores and p > cores:  # at most `cores` of the P processes compute at any moment
            ax.axhline(1 - cores / p, color="grey", linestyle="--", linewidth=1,
                       label=f"1 − {cores}/P: {cores} cores for {p} processes")
        for schedule, colour, marker in (("gpipe", "#1f77b4", "o"), ("1f1b", "#d62728", "s")):
            rows = sorted(data[p].get(schedule, []))
            xs = [m for m, _ in rows]
            mean = [sum(v) / len(v) for _, v in rows]
            lo = [min(v) for _, v in rows]
            hi = [max(v) for _, v in rows]
            ax.plot(xs, mean, marker=marker, color=colour, label=f"{schedule}, measured (mean of the stages)")
            ax.fill_between(xs, lo, hi, color=colour, alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8, 16])
        ax.set_xticklabels(["1", "2", "4", "8", "16"])
        ax.set_xlabel("micro-batches M", fontsize=9)
        ax.set_title(f"P = {p} stages", fontsize=10.5, loc="left")
        ax.set_ylim(0, 1)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].set_ylabel("idle fraction of a step", fontsize=9)
    for ax in axes:
        ax.legend(fontsize=8, frameon=False, loc="lower left")
    fig.suptitle("The bubble over CPU processes: measured idle time per stage against the formula "
                 "(shaded: least to most idle stage; a shared 2-core machine, 2026-12-02)", fontsize=10.5)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=os.path.join(HERE, "..", "bench", "results", "pipeline_cpu_2026-12-02.txt"))
    ap.add_argument("--traces", default=os.path.join(HERE, "..", "docs", "img"))
    ap.add_argument("--out-dir", default=os.path.join(HERE, "..", "docs", "img"))
    args = ap.parse_args()
    for f in [args.results] + [os.path.join(args.traces, f"pipeline_{s}_p4_m8.json") for s in ("gpipe", "1f1b")]:
        if not os.path.exists(f):
            print(f"plot_pipeline: no {f} (run bench/pipeline_cpu.py first)", file=sys.stderr)
            return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for name, draw in (("pipeline_timelines", lambda p: plot_timelines(p, plt, args.traces)),
                       ("pipeline_bubble", lambda p: plot_bubble(p, plt, args.results))):
        path = os.path.join(args.out_dir, name + ".png")
        draw(path)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
