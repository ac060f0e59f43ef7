#!/usr/bin/env python3
"""Draws the pipeline chapter's measured pictures (docs/11-pipelines.md) from bench/pipeline_cpu.py's and bench/pipeline_threads.sh's output.

From bench/pipeline_cpu.py (stages as processes over Gloo, --results and --traces):
  pipeline_timelines.png  GPipe and 1F1B side by side, one step (the shortest traced) of P = 4
                          stages and M = 8 micro-batches as the timelines of real runs recorded it (one lane per
                          stage process, one box per forward F or backward B)
  pipeline_bubble.png     the idle fraction per stage against M, measured (the mean over the
                          stages, the range between the least and the most idle stage) and the
                          formula (P - 1)/(M + P - 1), for P = 2 and P = 4

From bench/pipeline_threads.sh (stages as threads of one process, a core each):
  pipeline_bubble_threads.png     from its output (--threads-results): the same as pipeline_bubble.png
                                  for each P in the file, a row per sweep: 128 rows per micro-batch
                                  (every action as long whatever M, as the formula assumes) on top,
                                  the fixed batch of 256 rows below; the core count and date from the
                                  file's first line
  pipeline_timelines_threads.png  from its timelines (--threads-traces, the folder it wrote them to):
                                  the same as pipeline_timelines.png for the 128-row sweep's runs
                                  (pipeline_threads_rows128_{gpipe,1f1b}_p4_m8.json); the date from
                                  --threads-results's first line when given, else from the files'
                                  modification time

  /usr/bin/python3 scripts/plot_pipeline.py [--results FILE] [--traces DIR]
      [--threads-results FILE] [--threads-traces DIR] [--out-dir docs/img]

With neither --threads option it draws the two pictures of bench/pipeline_cpu.py; with one or
both, only the pictures they name, and those of bench/pipeline_cpu.py too when --results or
--traces is also given. Needs matplotlib (Debian: python3-matplotlib). Exit 2 on bad arguments
or missing inputs.
"""
import argparse
import datetime
import json
import os
import re
import sys
import textwrap

STAGE_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]  # stage 0..3, as ranks 0..3 elsewhere
SCHEDULES = (("gpipe", "#1f77b4", "o"), ("1f1b", "#d62728", "s"))  # colour and marker of each
ROWS = 128  # pipeline_threads.sh's rows per micro-batch in its second sweep ("rows128_" files)
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


def plot_timelines(path, plt, traces, title, m=8):
    """GPipe and 1F1B side by side from traces = {"gpipe": FILE, "1f1b": FILE}, each one step of M
    = m micro-batches, under `title`."""
    fig, axes = plt.subplots(1, 2, figsize=(13.5, 3.9), sharey=True)
    steps = {s: one_step(traces[s], m) for s in ("gpipe", "1f1b")}
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
    fig.suptitle(title, fontsize=11)
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


def read_threads(results):
    """({sweep title: {P: {schedule: [(M, [idle per stage])]}}}, cores, date) from the output of
    bench/pipeline_threads.sh: its sections ("## fixed batch 256, P = 4, 1f1b: | M | ...") and
    rows ("| M | step ms | idle of stage 0 | ... | idle of stage P-1 | formula | ..."), and the
    first line ("# 16 cores, 2026-12-05; ..."). cores and date are None where that line lacks them."""
    out, rows = {}, None
    with open(results) as f:
        first = f.readline()
        lines = [first] + f.readlines()
    cores = re.search(r"(\d+) cores", first)
    date = re.search(r"\d{4}-\d{2}-\d{2}", first)
    for line in lines:
        head = re.match(r"## (.+), P = (\d+), (gpipe|1f1b):", line)
        if head:
            p = int(head[2])
            rows = out.setdefault(head[1], {}).setdefault(p, {}).setdefault(head[3], [])
            continue
        if line.startswith("#"):
            rows = None
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if rows is not None and line.startswith("|") and len(cells) >= 2 + p:
            rows.append((int(cells[0]), [float(c) for c in cells[2:2 + p]]))
    return out, int(cores[1]) if cores else None, date[0] if date else None


def draw_idle(ax, p, data, cores=None, title=None, muted=False):
    """One panel of idle fraction against M for P = p: the formula, the line 1 - cores/P where the
    P stages share fewer cores, and per schedule of data = {schedule: [(M, [idle per stage])]}
    the mean over the stages, shaded from the least to the most idle stage. muted: thinner lines
    and a grey title, for a panel beside the main ones."""
    ms = [1 + i * 0.25 for i in range(61)]
    ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], color="black", linewidth=1.2,
            label="(P − 1)/(M + P − 1)")
    if cores and p > cores:  # at most `cores` of the P processes compute at any moment
        ax.axhline(1 - cores / p, color="grey", linestyle="--", linewidth=1,
                   label=f"1 − {cores}/P: {cores} cores for {p} processes")
    for schedule, colour, marker in SCHEDULES:
        rows = sorted(data.get(schedule, []))
        xs = [m for m, _ in rows]
        mean = [sum(v) / len(v) for _, v in rows]
        lo = [min(v) for _, v in rows]
        hi = [max(v) for _, v in rows]
        ax.plot(xs, mean, marker=marker, color=colour, label=f"{schedule}, measured (mean of the stages)",
                **({"linewidth": 1.0, "markersize": 4} if muted else {}))
        ax.fill_between(xs, lo, hi, color=colour, alpha=0.1 if muted else 0.15)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8, 16])
    ax.set_xticklabels(["1", "2", "4", "8", "16"])
    ax.set_xlabel("micro-batches M", fontsize=9)
    ax.set_title(title or f"P = {p} stages", fontsize=10.5, loc="left", **({"color": "dimgrey"} if muted else {}))
    ax.set_ylim(0, 1)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def plot_bubble(path, plt, results):
    data = read_idle(results)
    cores = re.search(r"(\d+) CPU cores", open(results).read())
    cores = int(cores[1]) if cores else None
    if not data:
        sys.exit(f"plot_pipeline: no step-time tables in {results}")
    fig, axes = plt.subplots(1, len(data), figsize=(11.5, 4.0), sharey=True)
    for ax, p in zip(axes, sorted(data)):
        draw_idle(ax, p, data[p], cores)
    axes[0].set_ylabel("idle fraction of a step", fontsize=9)
    for ax in axes:
        ax.legend(fontsize=8, frameon=False, loc="lower left")
    fig.suptitle("The bubble over CPU processes: measured idle time per stage against the formula "
                 "(shaded: least to most idle stage; a shared 2-core machine, 2026-12-02)", fontsize=10.5)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def machine(cores, date):
    """"a 16-core CPU machine, 2026-12-05", leaving out what is unknown."""
    return ", ".join(([f"a {cores}-core CPU machine"] if cores else []) + ([date] if date else []))


def plot_bubble_threads(path, plt, sweeps, cores, date):
    """A row of panels (one per P) per sweep of pipeline_threads.sh: the fixed rows per
    micro-batch on top and drawn larger, as there every action lasts as long whatever M, as the
    formula assumes; the fixed batch below, muted, as its actions get cheaper as M grows."""
    order = sorted(sweeps, key=lambda t: not t.startswith("fixed rows"))
    ps = sorted({p for by_p in sweeps.values() for p in by_p})
    width = max(5.75 * len(ps) + 0.5, 7.0)
    fig, axes = plt.subplots(len(order), len(ps), figsize=(width, 1.4 + 3.4 * len(order)), sharey=True,
                             squeeze=False, gridspec_kw={"height_ratios": [1.35] + [1] * (len(order) - 1)})
    for i, (row, sweep) in enumerate(zip(axes, order)):
        for ax, p in zip(row, ps):
            if p not in sweeps[sweep]:
                ax.set_axis_off()
                continue
            draw_idle(ax, p, sweeps[sweep][p], title=f"P = {p} stages, {sweep}", muted=i > 0)
        row[0].set_ylabel("idle fraction of a step", fontsize=9)
    axes[0][-1].legend(fontsize=8, frameon=False, loc="upper right")
    where = f", {machine(cores, date)}" if cores or date else ""
    lines = [f"The bubble with a core per stage (threads){where}: measured idle time per stage against the formula",
             "(shaded: least to most idle stage). Top: a fixed micro-batch, as the formula assumes; "
             "below: a fixed batch, each action cheaper as M grows"]
    chars = int(width * 12.5)  # what fits across the figure
    fig.suptitle("\n".join(lines) if max(map(len, lines)) <= chars else textwrap.fill(" ".join(lines), chars),
                 fontsize=10.5)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", help="bench/pipeline_cpu.py's output "
                    "(default bench/results/pipeline_cpu_2026-12-02.txt)")
    ap.add_argument("--traces", help="the folder of its timelines (default docs/img)")
    ap.add_argument("--threads-results", help="bench/pipeline_threads.sh's output")
    ap.add_argument("--threads-traces", help="the folder of its timelines (its $OUT)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "..", "docs", "img"))
    args = ap.parse_args()
    threads = args.threads_results or args.threads_traces
    processes = args.results or args.traces or not threads
    args.results = args.results or os.path.join(HERE, "..", "bench", "results", "pipeline_cpu_2026-12-02.txt")
    args.traces = args.traces or os.path.join(HERE, "..", "docs", "img")
    traces = {s: os.path.join(args.traces, f"pipeline_{s}_p4_m8.json") for s in ("gpipe", "1f1b")}
    needs = []  # (input, what writes it)
    if processes:
        needs += [(f, "bench/pipeline_cpu.py") for f in [args.results] + list(traces.values())]
    thread_traces = {s: os.path.join(args.threads_traces or "", f"pipeline_threads_rows{ROWS}_{s}_p4_m8.json")
                     for s in ("gpipe", "1f1b")}
    if args.threads_results:
        needs.append((args.threads_results, "bench/pipeline_threads.sh"))
    if args.threads_traces:  # QUICK=1 runs P = 2 only
        needs += [(f, "bench/pipeline_threads.sh without QUICK") for f in thread_traces.values()]
    for f, writer in needs:
        if not os.path.exists(f):
            print(f"plot_pipeline: no {f} (run {writer} first)", file=sys.stderr)
            return 2
    cores = date = None
    if args.threads_results:
        sweeps, cores, date = read_threads(args.threads_results)
        if not sweeps:
            print(f"plot_pipeline: no pipeline_threads.sh tables in {args.threads_results}", file=sys.stderr)
            return 2
    if args.threads_traces and not date:
        date = max(datetime.datetime.fromtimestamp(os.path.getmtime(f), datetime.timezone.utc)
                   for f in thread_traces.values()).strftime("%Y-%m-%d")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pictures = []
    if processes:
        title = ("One step of a 4-stage pipeline over 4 CPU processes (Gloo), 8 micro-batches: "
                 "F pale, B dark, white = idle (a 2-core machine, 2026-12-02)")
        pictures += [("pipeline_timelines", lambda p: plot_timelines(p, plt, traces, title)),
                     ("pipeline_bubble", lambda p: plot_bubble(p, plt, args.results))]
    if args.threads_results:
        pictures.append(("pipeline_bubble_threads", lambda p: plot_bubble_threads(p, plt, sweeps, cores, date)))
    if args.threads_traces:
        title_threads = (f"One step of a 4-stage pipeline as 4 threads with a core each, 8 micro-batches of "
                         f"{ROWS} rows: F pale, B dark, white = idle ({machine(cores, date)})")
        pictures.append(("pipeline_timelines_threads",
                         lambda p: plot_timelines(p, plt, thread_traces, title_threads)))
    os.makedirs(args.out_dir, exist_ok=True)
    for name, draw in pictures:
        path = os.path.join(args.out_dir, name + ".png")
        draw(path)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
