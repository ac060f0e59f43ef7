#!/usr/bin/env python3
"""The pipeline over CPU processes, measured (docs/11-pipelines.md, "The bubble, measured").

    /usr/bin/python3 bench/pipeline_cpu.py [--build build-cpu] [--out FILE] [--traces DIR]

Runs the test worker's `pipeline-bench` mode (one stage per process over Gloo, stages of equal
cost: L x (Linear(W, W) + ReLU) each) under tandem-run with OPENBLAS_NUM_THREADS=1, for P = 2
and P = 4 stages, GPipe and 1F1B, M = 1, 2, 4, 8, 16, and writes three tables:

  1. a batch of 256: step time, the idle fraction of each stage from the timeline
     (scripts/pipeline_idle.py) against (P - 1)/(M + P - 1);
  2. the same runs: each stage's allocator peak in the step above what was live before it,
     less the gradients the step allocates (every process is one stage: its peak is the
     stage's own), i.e. the activations and scratch of the step;
  3. micro-batches of a fixed 32 rows (so the batch grows with M): the same peak.

Then two timelines of P = 4, M = 8 (with P = 2's larger stages) go to --traces
(pipeline_gpipe_p4_m8.json, pipeline_1f1b_p4_m8.json) for scripts/plot_pipeline.py. Exit 2 on bad arguments, 1 when a run fails.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import pipeline_idle  # noqa: E402

# Per-stage cost: P = 4 stages share two cores four ways, so each is made smaller.
SHAPES = {2: dict(width=512, layers=4), 4: dict(width=256, layers=4)}
MS = [1, 2, 4, 8, 16]
SCHEDULES = ["gpipe", "1f1b"]
LINE = re.compile(r"stage (\d+) (\w+) M (\d+) batch (\d+) steps (\d+): ([.\d]+) ms per step, "
                  r"peak ([.\d]+) MB above live, of which gradients ([.\d]+) MB, in_flight (\d+)")


def run(build, p, schedule, m, steps, trace=None, rows=0, shape=None):
    shape = shape or SHAPES[p]
    cmd = [os.path.join(build, "examples", "tandem-run"), "--standalone", "--grace-seconds", "1",
           "--nproc-per-node", str(p), os.path.join(build, "tests", "tandem_dist_worker"), "pipeline-bench",
           "--schedule", schedule, "--micro-batches", str(m), "--steps", str(steps),
           "--width", str(shape["width"]), "--layers", str(shape["layers"])]
    if rows:
        cmd += ["--rows", str(rows)]
    if trace:
        cmd += ["--trace", trace]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", TANDEM_DIST_TIMEOUT="120")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"pipeline_cpu: {' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    stages = {}
    for g in LINE.finditer(out.stdout):
        stages[int(g[1])] = dict(ms=float(g[6]), act_mb=float(g[7]) - float(g[8]), in_flight=int(g[9]))
    if len(stages) != p:
        sys.exit(f"pipeline_cpu: expected {p} stage lines from {' '.join(cmd)}:\n{out.stdout}")
    return stages


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build-cpu")
    ap.add_argument("--out", default="bench/results/pipeline_cpu_2026-12-02.txt")
    ap.add_argument("--traces", default="docs/img")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the first warms up)")
    args = ap.parse_args()
    for tool in ("examples/tandem-run", "tests/tandem_dist_worker"):
        if not os.path.exists(os.path.join(args.build, tool)):
            print(f"pipeline_cpu: no {tool} in {args.build} (build tandem_dist_worker and tandem-run)",
                  file=sys.stderr)
            sys.exit(2)
    os.makedirs(args.traces, exist_ok=True)
    tmp = tempfile.mkdtemp()
    out = []
    nproc = os.cpu_count()
    out.append(f"# pipeline over CPU processes (Gloo), bench/pipeline_cpu.py; {nproc} CPU cores shared with "
               "other work, OPENBLAS_NUM_THREADS=1: rough numbers")
    for p in (2, 4):
        shape = SHAPES[p]
        timing, memory, fixed = [], [], []
        for schedule in SCHEDULES:
            for m in MS:
                trace = os.path.join(tmp, f"{schedule}_p{p}_m{m}.json")
                stages = run(args.build, p, schedule, m, args.steps, trace=trace)
                _, step_ms, idle = pipeline_idle.measure(trace, m)
                timing.append([schedule, str(m), f"{step_ms:.1f}"] + [f"{idle[s]:.2f}" for s in sorted(idle)] +
                              [f"{(p - 1) / (m + p - 1):.2f}"])
                memory.append([schedule, str(m)] + [f"{stages[s]['act_mb']:.3f}" for s in range(p)] +
                              [" / ".join(str(stages[s]["in_flight"]) for s in range(p))])
                big = run(args.build, p, schedule, m, 3, rows=32)
                fixed.append([schedule, str(m), str(32 * m)] + [f"{big[s]['act_mb']:.3f}" for s in range(p)])
                print(f"P {p} {schedule} M {m}: {step_ms:.1f} ms", file=sys.stderr)
        cost = f"{shape['layers']} x (Linear({shape['width']}, {shape['width']}) + ReLU) per stage"
        stage_cols = [f"stage {s}" for s in range(p)]
        out.append(f"\n## P = {p}: step time and idle fraction per stage, batch 256, {cost}, "
                   f"{args.steps - 2} steps after a warm-up\n")
        out.append(table(["schedule", "M", "step (ms)"] + [f"idle, {c}" for c in stage_cols] + ["(p-1)/(m+p-1)"],
                         timing))
        out.append(f"\n## P = {p}: peak activation memory per stage (MB above live, less the gradients), batch 256\n")
        out.append(table(["schedule", "M"] + stage_cols + ["micro-batches held"], memory))
        out.append(f"\n## P = {p}: the same with micro-batches of 32 rows (batch 32 M)\n")
        out.append(table(["schedule", "M", "batch"] + stage_cols, fixed))
    # The pictures' timelines: P = 4, M = 8, with the larger stages of P = 2 so that the
    # actions, not the messages, fill the lanes.
    for schedule in SCHEDULES:
        run(args.build, 4, schedule, 8, 8, trace=os.path.join(args.traces, f"pipeline_{schedule}_p4_m8.json"),
            shape=SHAPES[2])
    out.append(f"\n(timelines for scripts/plot_pipeline.py: P = 4, M = 8, {SHAPES[2]['layers']} x "
               f"(Linear({SHAPES[2]['width']}, {SHAPES[2]['width']}) + ReLU) per stage, in "
               f"{args.traces}/pipeline_{{gpipe,1f1b}}_p4_m8.json)")
    text = "\n".join(out) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
