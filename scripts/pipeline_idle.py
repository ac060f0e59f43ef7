#!/usr/bin/env python3
"""Step time and idle fraction per stage from a pipeline timeline (docs/11-pipelines.md).

    python3 scripts/pipeline_idle.py TRACE.json M [ONE_STAGE.json]

TRACE.json is a merged timeline with one process (pid) per stage and one span per action
("F3", "B3"), as `lenet --parallel pipeline --trace` under tandem-run or the test worker's
`pipeline-bench` write it; M is the micro-batches per step. Each stage's spans are cut into
steps of 2M actions; a step lasts from its first action's start on any stage to its last
action's end on any stage, and a stage is idle for the part of it in none of its own spans
(waiting for a neighbour, sending, the step's end). The first traced step is skipped (warm-up).
Prints a Markdown row: M, mean step ms, idle fraction per stage, (P-1)/(M+P-1), the idle fraction
averaged over the stages, and that mean less the formula. ONE_STAGE.json, the timeline of the
same M micro-batches through one stage alone (`bench_pipeline --stages 1`), adds its step ms T1
and the step the formula predicts, T1 (M+P-1)/M: every action as long as alone, idle only in the
bubble.
"""
import json
import sys


def measure(path, m):
    """(P, mean step in ms, {stage pid: mean idle fraction}) of the trace at `path`."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    stages = {}
    for e in events:
        stages.setdefault(e["pid"], []).append(e)
    for spans in stages.values():
        spans.sort(key=lambda e: e["ts"])
    p = len(stages)
    steps = min(len(v) for v in stages.values()) // (2 * m)
    windows, idle = [], {s: [] for s in stages}
    for k in range(1, steps):
        step = {s: v[k * 2 * m:(k + 1) * 2 * m] for s, v in stages.items()}
        t0 = min(v[0]["ts"] for v in step.values())
        t1 = max(v[-1]["ts"] + v[-1]["dur"] for v in step.values())
        windows.append(t1 - t0)
        for s, v in step.items():
            idle[s].append(1 - sum(e["dur"] for e in v) / (t1 - t0))
    mean = lambda v: sum(v) / len(v)
    return p, mean(windows) / 1000, {s: mean(v) for s, v in idle.items()}


def main():
    if len(sys.argv) not in (3, 4):
        print("usage: pipeline_idle.py TRACE.json M [ONE_STAGE.json]", file=sys.stderr)
        sys.exit(2)
    path, m = sys.argv[1], int(sys.argv[2])
    p, step_ms, idle = measure(path, m)
    formula = (p - 1) / (m + p - 1)
    mean_idle = sum(idle.values()) / p
    cells = [str(m), f"{step_ms:.1f}"] + [f"{idle[s]:.2f}" for s in sorted(idle)]
    cells += [f"{formula:.2f}", f"{mean_idle:.2f}", f"{mean_idle - formula:+.2f}"]
    if len(sys.argv) == 4:
        _, one_ms, _ = measure(sys.argv[3], m)
        cells += [f"{one_ms:.1f}", f"{one_ms * (m + p - 1) / m:.1f}"]
    print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
