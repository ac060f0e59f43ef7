"""Prints the benchmark results (one JSON object per line) as a table."""
import json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
kinds = {}
for r in rows:
    kinds.setdefault(r.get("kind", "train"), []).append(r)

if kinds.get("train"):
    w = max(24, *(len(r["path"]) for r in kinds["train"]))  # e.g. pytorch's compile+graph+cl+bf16+bench
    print(f"{'model':<9} {'framework':<9} {'path':<{w}} {'dev':>3} {'batch':>5} {'s/epoch':>8} {'images/s':>10} "
          f"{'peak MB':>8}")
    for r in kinds["train"]:
        peak = f"{r['peak_mb']:>8.0f}" if "peak_mb" in r else f"{'':>8}"
        print(f"{r['model']:<9} {r['framework']:<9} {r['path']:<{w}} {r['devices']:>3} {r['batch_size']:>5} "
              f"{r['median_s']:>8.3f} {r['images_per_s']:>10.0f} {peak}")
if kinds.get("allreduce"):
    print()
    print(f"{'allreduce':<10} {'framework':<9} {'bytes':>10} {'time_us':>9} {'busbw_GB/s':>11}")
    for r in kinds["allreduce"]:
        print(f"{r['algo']:<10} {r['framework']:<9} {r['bytes']:>10} {r['time_us']:>9.1f} {r['busbw_gbs']:>11.1f}")
