"""Sums kernel times from `ncu --csv --metrics gpu__time_duration.sum` output by kernel name and
prints the kernels that take most of the time (their count, total µs and share).

  ncu --csv --clock-control none --cache-control none --profile-from-start off \
      --metrics gpu__time_duration.sum ./build-gpu/bench/bench_step --profile > k.csv
  python3 bench/ncu_summary.py k.csv [--top 40]
"""
import argparse, collections, csv, re, sys


def short(name):
    name = re.sub(r"\(.*", "", name)  # drop the argument list
    name = re.sub(r"<.*>", "<>", name)  # and template arguments
    return name.replace("void ", "")[:80]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--order", action="store_true", help="also list every kernel in launch order")
    args = ap.parse_args()
    with open(args.csv) as f:
        lines = [l for l in f if l.startswith('"')]
    total = collections.Counter()
    count = collections.Counter()
    seq = []
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "ns")
        us = v / 1000 if unit in ("nsecond", "ns") else v * 1000 if unit in ("msecond", "ms") else v
        k = short(row["Kernel Name"])
        seq.append((k, us))
        total[k] += us
        count[k] += 1
    if args.order:
        print(f"{'#':>4s} {'kernel, in launch order':80s} {'us':>8s}")
        for i, (k, us) in enumerate(seq):
            print(f"{i:4d} {k:80s} {us:8.1f}")
    s = sum(total.values())
    print(f"{sum(count.values())} kernels, {s:.1f} us in all")
    print(f"{'kernel':80s} {'n':>4s} {'us':>9s} {'share':>6s}")
    for k, us in total.most_common(args.top):
        print(f"{k:80s} {count[k]:4d} {us:9.1f} {100 * us / s:5.1f}%")


if __name__ == "__main__":
    sys.exit(main())
