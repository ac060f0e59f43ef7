"""Two replayed steps side by side, kernel by kernel: where a change moved the GPU time.

Reads two summaries that bench/timeline_summary.py --json wrote (the median replay of each) and
prints, for every kernel (its namespaces and its numeric and boolean template arguments dropped,
so a kernel whose vector width changed is still one row), the microseconds per replay and the
node count before and after, largest first, then the period and the busy time of each.

  python3 bench/timeline_diff.py BASE.summary.json NEW.summary.json [--rows 25]
"""
import argparse, json, re, sys
from collections import Counter


def kernel(name):
    """A kernel's name without namespaces, parameters and numeric or boolean template arguments,
    so that a kernel whose vector width or index type changed is still one row:
    'void tandem::gpu::channel_partials_last<8, 2, tandem::gpu::BnStatsLast<tandem::BFloat16>>(...)'
    -> 'channel_partials_last<BnStatsLast<BFloat16>>'."""
    if name.startswith(("memcpy", "memset")):
        return name.split(" ")[0]
    name = name.replace("void ", "").replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(name):  # the parameter list: the first "(" outside the template arguments
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    name = re.sub(r"\b[A-Za-z_]\w*::", "", name)
    number = r"\s*(-?\d+|unsigned int|unsigned long|long|int|bool|true|false)\s*"
    while True:  # one argument at a time: neighbours share their commas
        shorter = re.sub(r"([<,])" + number + r"(?=[,>])", r"\1", name)
        shorter = re.sub(r"<,+", "<", re.sub(r",+>", ">", re.sub(r",\s*,", ",", shorter))).replace("<>", "")
        if shorter == name:
            return re.sub(r"\s*([<>])\s*", r"\1", name).strip()
        name = shorter


def load(path):
    try:
        with open(path) as f:
            d = json.load(f)
        return d, d["nodes"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"timeline_diff: {path}: not a timeline_summary.py --json file ({e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    (db, nb), (dn, nn) = load(args.base), load(args.new)
    t = {"base": Counter(), "new": Counter()}
    k = {"base": Counter(), "new": Counter()}
    for side, nodes in (("base", nb), ("new", nn)):
        for n in nodes:
            t[side][kernel(n["name"])] += n["dur"]
            k[side][kernel(n["name"])] += 1
    names = sorted(set(t["base"]) | set(t["new"]), key=lambda x: -max(t["base"][x], t["new"][x]))
    print(f"{'base us':>9} {'nodes':>5} {'new us':>9} {'nodes':>5} {'change':>8}  kernel")
    for name in names[:args.rows]:
        b, n = t["base"][name], t["new"][name]
        print(f"{b:9.1f} {k['base'][name]:5d} {n:9.1f} {k['new'][name]:5d} {n - b:+8.1f}  {name}")
    rest = names[args.rows:]
    if rest:
        b, n = sum(t["base"][x] for x in rest), sum(t["new"][x] for x in rest)
        print(f"{b:9.1f} {'':5} {n:9.1f} {'':5} {n - b:+8.1f}  ({len(rest)} more kernels)")
    for label, d, nodes in (("base", db, nb), ("new", dn, nn)):
        print(f"{label}: period {d['period_us']:.1f} us, busy {d['busy_us']:.1f} us, {len(nodes)} nodes")


if __name__ == "__main__":
    main()
