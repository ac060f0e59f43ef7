"""bench/timeline_summary.py on traces made here, where every figure is known in advance:
the replays of a graph are found by their shared correlation id (and told apart from a
smaller graph and from the work between replays), their medians come out as built, the
median replay is written with --json, PyTorch's trace format reads the same, and bad traces
end with a message and a non-zero exit.

  python3 tests/bench/test_timeline_summary.py SUMMARY_SCRIPT
"""
import json, os, subprocess, sys, tempfile

SCRIPT = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAILED:", what)


def write_trace(path, events, as_list=False):
    with open(path, "w") as f:
        json.dump(events if as_list else {"traceEvents": events}, f)


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def graph_trace(replays=30, nodes=12, memcpy_cat="memcpy"):
    """`replays` replays of a `nodes`-node graph, node k lasting 2 + 0.5 k us with 1 us gaps,
    a 3 us memcpy between replays, every replay starting 80 us after the last; plus one
    replay of a 15-node graph before them (another capture) and host events to ignore."""
    ev = []
    t = 0.0
    for k in range(15):
        ev.append({"ph": "X", "cat": "kernel", "name": f"other{k}", "ts": t, "dur": 1.0, "args": {"correlation": 1}})
        t += 2.0
    t = 100.0
    for r in range(replays):
        start = t
        for k in range(nodes):
            d = 2.0 + 0.5 * k
            ev.append({"ph": "X", "cat": "kernel", "name": f"void node{k}<float>(int)", "ts": t, "dur": d,
                       "args": {"correlation": 1000 + r}})
            t += d + 1.0
        ev.append({"ph": "X", "cat": memcpy_cat, "name": "memcpy 4096 B", "ts": t + 1.0, "dur": 3.0,
                   "args": {"correlation": 5000 + r}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t, "dur": 5.0,
                   "args": {"correlation": 1000 + r}})
        t = start + 80.0
    return ev


with tempfile.TemporaryDirectory() as tmp:
    trace = os.path.join(tmp, "t.json")
    out_json = os.path.join(tmp, "s.json")
    write_trace(trace, graph_trace())
    r = run(trace, "--label", "built", "--skip", "5", "--json", out_json)
    check(r.returncode == 0, f"a good trace is read (exit {r.returncode}: {r.stderr})")
    head = r.stdout.splitlines()[0] if r.stdout else ""
    # 12 nodes of 2 + 0.5 k us: 57 us busy; 11 gaps of 1 us: a 68 us span; 80 us period.
    check(head.startswith("built: 25 replays of a 12-node graph"), f"replays found: {head!r}")
    check("busy 57.0 us" in head, f"busy time: {head!r}")
    check("span 68.0 us" in head, f"span: {head!r}")
    check("idle in graph 11.0 us" in head, f"idle time inside the graph: {head!r}")
    check("memcpy 4096 B" in r.stdout, "the work between replays is listed")
    with open(out_json) as f:
        s = json.load(f)
    check(s["label"] == "built" and len(s["nodes"]) == 12, "the median replay is written")
    check(abs(s["nodes"][3]["dur"] - 3.5) < 1e-9 and abs(s["nodes"][3]["gap"] - 1.0) < 1e-9,
          f"node durations and gaps: {s['nodes'][3]}")
    check(abs(s["nodes"][1]["offset"] - 3.0) < 1e-9, f"node offsets: {s['nodes'][1]}")
    check(abs(s["period_us"] - 80.0) < 1e-9, f"period: {s['period_us']}")
    check("between replays 12.0 us" in head, f"time between replays: {head!r}")
    check("node3<float>" in r.stdout and "void node3" not in r.stdout and "(int)" not in r.stdout,
          "names are shortened to the kernel's name")

    # PyTorch's profiler writes a list of events too, and "gpu_memcpy" for copies.
    write_trace(trace, graph_trace(memcpy_cat="gpu_memcpy"), as_list=True)
    r = run(trace, "--skip", "5")
    check(r.returncode == 0 and "25 replays of a 12-node graph" in r.stdout, f"a PyTorch-style trace: {r.stderr}")
    check("memcpy 4096 B" in r.stdout, "PyTorch's gpu_memcpy counts as work between replays")

    # Not a trace at all.
    with open(trace, "w") as f:
        f.write("{ half a trace")
    r = run(trace)
    check(r.returncode != 0 and "not a JSON trace" in r.stderr, f"a broken file: {r.stderr!r}")

    # No graph at all: one kernel per launch.
    write_trace(trace, [{"ph": "X", "cat": "kernel", "name": "k", "ts": i, "dur": 1, "args": {"correlation": i}}
                        for i in range(50)])
    r = run(trace)
    check(r.returncode != 0 and "no graph replay" in r.stderr, f"no replays: exit {r.returncode}, {r.stderr!r}")

    # Fewer replays than the warm-up to skip.
    write_trace(trace, graph_trace(replays=6))
    r = run(trace, "--skip", "20")
    check(r.returncode != 0 and "need more than --skip 20" in r.stderr, f"too few replays: {r.stderr!r}")

print(f"{len(failures)} failures" if failures else "all checks passed")
sys.exit(1 if failures else 0)
