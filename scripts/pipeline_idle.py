#!/usr/bin/env python3
"""Step time and idle fraction per stage from a pipeline timeline (docs/11-pipelines.md).

    python3 scripts/pipeline_idle.py TRACE.json M

TRACE.json is a merged timeline with one process (pid) per stage and one span per action
("F3", "B3"), as `lenet --parallel pipeline --trace` under tandem-run or the test worker's
`pipeline-bench` write it; M is the micro-batches per step. Each stage's spans are cut into
steps of 2M actions; a step lasts from its first action's start on any stage to its last
action's end on any stage, and a stage is idle for the part of it in none of its own spans
(waiting for a neighbour, sending, the step's end). The first traced step is skipped (warm-up).
Prints a Markdown row: M, mean step ms, idle fraction per stage, and (P-1)/(M+P-1).
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
    path, m = sys.argv[1], int(sys.argv[2])
    p, step_ms, idle = measure(path, m)
    cells = [str(m), f"{step_ms:.1f}"] + [f"{idle[s]:.2f}" for s in sorted(idle)]
    print("| " + " | ".join(cells + [f"{(p - 1) / (m + p - 1):.2f}"]) + " |")


if __name__ == "__main__":
    main()
