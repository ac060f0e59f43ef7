"""One row per kernel launch from `ncu --csv --metrics A,B,...` output: the kernel's short name and
each metric's value, in launch order; the columns are the metrics asked for.

  ncu --csv --profile-from-start off --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \\
      ./build-gpu/bench/bench_bn --profile > k.csv
  python3 bench/ncu_metrics.py k.csv
"""
import argparse, csv, re, sys

# Short column titles for the metrics bench/bn_gpu.sh asks for; others print under their names.
TITLES = {
    "gpu__time_duration.sum": "us",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
    "dram__bytes_read.sum": "read MB",
    "dram__bytes_write.sum": "write MB",
    "lts__t_sector_hit_rate.pct": "L2 hit %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occup %",
    "launch__registers_per_thread": "regs",
    "launch__grid_size": "blocks",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "mem stall",
}


def short(name):
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"tandem::gpu::", "", name)
    name = re.sub(r"tandem::", "", name)
    return name[:70]


def value(row):
    v = float(row["Metric Value"].replace(",", ""))
    unit = row.get("Metric Unit", "")
    if row["Metric Name"] == "gpu__time_duration.sum":
        return v / 1000 if unit in ("nsecond", "ns") else v * 1000 if unit in ("msecond", "ms") else v
    if unit in ("byte", "Kbyte", "Mbyte", "Gbyte"):
        return v * {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1, "Gbyte": 1e3}[unit]
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    args = ap.parse_args()
    with open(args.csv) as f:
        lines = [l for l in f if l.startswith('"')]
    launches, metrics = {}, []
    for row in csv.DictReader(lines):
        key = (int(row["ID"]), short(row["Kernel Name"]))
        m = row["Metric Name"]
        if m not in metrics:
            metrics.append(m)
        launches.setdefault(key, {})[m] = value(row)
    if not launches:
        print("ncu_metrics.py: no kernel in " + args.csv, file=sys.stderr)
        return 1
    titles = [TITLES.get(m, m) for m in metrics]
    print(f"{'kernel':70s} " + " ".join(f"{t:>10s}" for t in titles))
    for (_, name), vals in sorted(launches.items()):
        print(f"{name:70s} " + " ".join(f"{vals.get(m, float('nan')):10.1f}" for m in metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
