"""Where the GPU time of a replayed CUDA graph goes, from a kernel timeline.

Reads a Chrome trace of GPU activity -- bench/kernel_timeline.cpp's, or PyTorch's profiler's
(both give each kernel, memcpy and memset an "X" event with the correlation id of the host call
that launched it) -- and finds the replays of a graph: every kernel of one cudaGraphLaunch has
that launch's correlation id, so a group of at least --min-nodes events with one id is a replay.
Of the replays after the first --skip (warm-up), it prints:

  period   start of one replay to the start of the next (the step time, with what runs between)
  span     first node's start to the last node's end (the graph alone)
  busy     time some node was running; span - busy is the GPU waiting between nodes
  between  the work outside the graph from one replay to the next (input copies, metrics)

and, node by node in launch order, the median duration and the median idle gap before it, so a
slow node and the cost of a node boundary are both visible. --json writes the median replay
(offsets and durations per node) for scripts/plot_timeline.py.

  python3 bench/timeline_summary.py TRACE.json [--label tandem] [--skip 20] [--json OUT.json]
"""
import argparse, bisect, json, statistics, sys
from collections import defaultdict

GPU_CATS = {"kernel", "memcpy", "memset", "gpu_memcpy", "gpu_memset"}


def gpu_events(path):
    try:
        with open(path) as f:
            trace = json.load(f)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"timeline_summary: {path}: not a JSON trace with traceEvents ({e})")
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        corr = (e.get("args") or {}).get("correlation")
        if corr is None:
            continue
        out.append({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"]), "corr": corr})
    return sorted(out, key=lambda e: e["ts"])


def short(name, width=70):
    name = name.replace("(anonymous namespace)::", "").replace("void ", "")
    if not name.startswith(("memcpy", "memset")):
        name = name.split("(")[0]
    return name if len(name) <= width else name[:width - 1] + "…"


def busy_time(nodes):
    busy, end = 0.0, None
    for n in nodes:
        s, e = n["ts"], n["ts"] + n["dur"]
        if end is None or s >= end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--label", default="")
    ap.add_argument("--skip", type=int, default=20, help="replays to leave out first (warm-up)")
    ap.add_argument("--min-nodes", type=int, default=10)
    ap.add_argument("--json", help="write the median replay here")
    args = ap.parse_args()

    events = gpu_events(args.trace)
    groups = defaultdict(list)
    for e in events:
        groups[e["corr"]].append(e)
    replays = sorted((g for g in groups.values() if len(g) >= args.min_nodes), key=lambda g: g[0]["ts"])
    if not replays:
        sys.exit(f"timeline_summary: no graph replay (a launch of >= {args.min_nodes} nodes) in {args.trace}")
    # Replays of the graph that ran most often (a program may capture more than one).
    sizes = defaultdict(int)
    for g in replays:
        sizes[len(g)] += 1
    n_nodes = max(sizes, key=sizes.get)
    replays = [g for g in replays if len(g) == n_nodes]
    if len(replays) <= args.skip + 1:
        sys.exit(f"timeline_summary: {len(replays)} replays of {n_nodes} nodes in {args.trace}, "
                 f"need more than --skip {args.skip} + 1")
    replays = replays[args.skip:]
    starts = [g[0]["ts"] for g in replays]
    ends = [max(n["ts"] + n["dur"] for n in g) for g in replays]
    periods = [b - a for a, b in zip(starts, starts[1:])]
    spans = [e - s for s, e in zip(starts, ends)]
    busies = [busy_time(g) for g in replays]
    between = defaultdict(list)  # what ran between replay i and i+1, by name
    in_graph = {id(n) for g in replays for n in g}
    ts = [e["ts"] for e in events]
    for i in range(len(replays) - 1):
        for e in events[bisect.bisect_left(ts, ends[i]):bisect.bisect_left(ts, starts[i + 1])]:
            if id(e) not in in_graph:
                between[e["name"]].append(e["dur"])
    med = statistics.median
    label = f"{args.label}: " if args.label else ""
    print(f"{label}{len(replays)} replays of a {n_nodes}-node graph: period {med(periods):.1f} us, "
          f"span {med(spans):.1f} us, busy {med(busies):.1f} us, idle in graph {med(spans) - med(busies):.1f} us, "
          f"between replays {med(periods) - med(spans):.1f} us")
    rows = []
    for k in range(n_nodes):
        durs = [g[k]["dur"] for g in replays]
        gaps = [g[k]["ts"] - (g[k - 1]["ts"] + g[k - 1]["dur"]) if k else 0.0 for g in replays]
        offs = [g[k]["ts"] - g[0]["ts"] for g in replays]
        rows.append({"name": replays[0][k]["name"], "dur": med(durs), "gap": med(gaps), "offset": med(offs)})
    print(f"{'#':>3} {'us':>7} {'gap':>6}  node")
    for k, r in enumerate(rows):
        print(f"{k:>3} {r['dur']:7.2f} {r['gap']:6.2f}  {short(r['name'])}")
    if between:
        print("between replays (per step):")
        for name, durs in sorted(between.items(), key=lambda kv: -sum(kv[1])):
            print(f"    {sum(durs) / (len(replays) - 1):7.2f} us  {len(durs) / (len(replays) - 1):4.1f}x  {short(name)}")
    by_name = defaultdict(float)
    for r in rows:
        by_name[short(r["name"], 50)] += r["dur"]
    print("by kernel (median us per replay):")
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]:
        print(f"    {t:7.2f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "period_us": med(periods), "span_us": med(spans),
                       "busy_us": med(busies), "nodes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
