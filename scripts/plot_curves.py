#!/usr/bin/env python3
"""Draws training curves from the examples' --csv files as one PNG: the loss per epoch on the
left, train (solid) and test (dashed) accuracy per epoch on the right, one colour per run.

  python3 scripts/plot_curves.py --csv sigmoid.csv --label "LeNet sigmoid" \
                                 --csv relu.csv --label "LeNet ReLU" --out docs/img/curves.png

Each CSV has the header epoch,loss,train_acc,test_acc,seconds,images_per_s (lenet/resnet
--csv). Labels pair with the CSVs in order; without any, a run is named after its file.
Needs matplotlib (Debian: python3-matplotlib). Exit 2 on bad arguments, 1 on a file that
cannot be read or is not such a CSV.
"""
import argparse
import csv
import os
import sys

COLUMNS = ["epoch", "loss", "train_acc", "test_acc"]


def read_run(path):
    """The columns of one CSV as lists of floats, keyed by name."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise RuntimeError(f"{path}: {e.strerror}")
    if not rows:
        raise RuntimeError(f"{path}: no rows")
    missing = [c for c in COLUMNS if c not in rows[0]]
    if missing:
        raise RuntimeError(f"{path}: missing column(s) {', '.join(missing)}; expected {','.join(COLUMNS)},...")
    try:
        return {c: [float(r[c]) for r in rows] for c in COLUMNS}
    except (TypeError, ValueError) as e:
        raise RuntimeError(f"{path}: {e}")


def plot(runs, labels, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (run, label) in enumerate(zip(runs, labels)):
        color = f"C{i}"
        ax_loss.plot(run["epoch"], run["loss"], "o-", color=color, label=label)
        ax_acc.plot(run["epoch"], run["train_acc"], "o-", color=color, label=f"{label} train")
        ax_acc.plot(run["epoch"], run["test_acc"], "s--", color=color, label=f"{label} test")
    ax_loss.set(xlabel="epoch", ylabel="training loss", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    p = argparse.ArgumentParser(description="Training curves from the examples' CSV files, as one PNG.")
    p.add_argument("--csv", action="append", required=True, help="a CSV written by --csv (repeat for several runs)")
    p.add_argument("--label", action="append", default=[], help="legend name of the matching --csv, in order")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--title", default="", help="figure title")
    a = p.parse_args()
    if a.label and len(a.label) != len(a.csv):
        p.error(f"{len(a.label)} --label for {len(a.csv)} --csv; give one per CSV or none")
    labels = a.label or [os.path.splitext(os.path.basename(c))[0] for c in a.csv]
    try:
        runs = [read_run(c) for c in a.csv]
        plot(runs, labels, a.out, a.title)
    except RuntimeError as e:
        print(f"plot_curves: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"plot_curves: {a.out}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
