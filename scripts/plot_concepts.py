#!/usr/bin/env python3
"""Draws the book's concept pictures (no measured data: they show how the algorithms work).

  ring_allreduce.png   the ring allreduce on 4 ranks: reduce-scatter, then all-gather, step by
                       step, with the schedule of parallel/comm_ring.cpp
  ddp_buckets.png      DDP's buckets filling in reverse layer order during backward, each
                       bucket's allreduce overlapping the rest of backward (parallel/reducer.h)
  job_topology.png     a job on two nodes: a launcher per node, the ranks it starts, the TCP
                       store in rank 0's process, the NCCL / Gloo connections between ranks

  python3 scripts/plot_concepts.py [--out-dir docs/img] [--only NAME]

Needs matplotlib (Debian: python3-matplotlib). Exit 2 on bad arguments.
"""
import argparse
import os
import sys

RANK_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]  # rank 0..3
EMPTY = "#eeeeee"


# ---------------------------------------------------------------- ring allreduce

def ring_states(n):
    """The ring allreduce of parallel/comm_ring.cpp on n ranks, as a list of
    (title, subtitle, state, received) where state[rank][chunk] is the set of ranks whose data
    that copy of the chunk holds, and received the (rank, chunk) cells written in the step."""
    state = [[{r} for _ in range(n)] for r in range(n)]
    out = [("start", "rank i holds its own\ngradient, cut in 4 chunks", [[set(c) for c in row] for row in state], set())]
    for s in range(n - 1):  # reduce-scatter: rank i sends chunk i - s to rank i + 1, which adds
        sends = [(i, (i + 1) % n, (i - s) % n) for i in range(n)]
        new = [[set(c) for c in row] for row in state]
        for src, dst, c in sends:
            new[dst][c] = state[dst][c] | state[src][c]
        state = new
        out.append((f"reduce-scatter, step {s + 1}",
                    f"rank i sends chunk i−{s} to rank i+1,\nwhich adds it to its own" if s else
                    "rank i sends chunk i to rank i+1,\nwhich adds it to its own",
                    [[set(c) for c in row] for row in state], {(d, c) for _, d, c in sends}))
    for s in range(n - 1):  # all-gather: rank i passes on chunk i + 1 - s, which rank i+1 copies
        sends = [(i, (i + 1) % n, (i + 1 - s) % n) for i in range(n)]
        new = [[set(c) for c in row] for row in state]
        for src, dst, c in sends:
            new[dst][c] = set(state[src][c])
        state = new
        out.append((f"all-gather, step {s + 1}",
                    ("rank i sends its finished chunk i+1\nto rank i+1, which copies it" if s == 0 else
                     "rank i passes on chunk " + ("i" if s == 1 else f"i−{s - 1}") +
                     "\nto rank i+1, which copies it"),
                    [[set(c) for c in row] for row in state], {(d, c) for _, d, c in sends}))
    return out


def draw_ring_panel(ax, n, title, subtitle, state, received, patches):
    cw, ch, gap = 1.0, 0.62, 0.45  # chunk cell width and height, gap between ranks
    for r in range(n):
        x0 = r * (cw + gap)
        for c in range(n):
            y0 = (n - 1 - c) * ch
            held = state[r][c]
            sliver = cw / n
            for k in range(n):  # one sliver per rank: coloured when that rank's data is in it
                ax.add_patch(patches.Rectangle((x0 + k * sliver, y0), sliver, ch * 0.92,
                                               facecolor=RANK_COLOURS[k] if k in held else EMPTY,
                                               edgecolor="none"))
            done = len(held) == n
            ax.add_patch(patches.Rectangle((x0, y0), cw, ch * 0.92, fill=False,
                                           edgecolor="black",
                                           linewidth=2.6 if (r, c) in received else 0.6))
            if done:
                ax.text(x0 + cw / 2, y0 + ch * 0.46, "Σ", ha="center", va="center",
                        fontsize=11, color="white", fontweight="bold")
        ax.text(x0 + cw / 2, n * ch + 0.08, f"rank {r}", ha="center", va="bottom", fontsize=9,
                color=RANK_COLOURS[r], fontweight="bold")
    for c in range(n):
        ax.text(-0.12, (n - 1 - c) * ch + ch * 0.46, f"chunk {c}", ha="right", va="center", fontsize=7.5)
    ax.set_xlim(-1.05, n * (cw + gap) - gap + 0.05)
    ax.set_ylim(-0.75, n * ch + 0.75)
    ax.set_title(title, fontsize=10.5, fontweight="bold", pad=2)
    ax.text((n * (cw + gap) - gap) / 2, -0.12, subtitle, ha="center", va="top", fontsize=8)
    ax.axis("off")


def plot_ring(path, plt, patches):
    n = 4
    states = ring_states(n)
    fig, axes = plt.subplots(2, 4, figsize=(13.5, 6.6))
    layout = [axes[0][0], axes[0][1], axes[0][2], axes[0][3], axes[1][1], axes[1][2], axes[1][3]]
    for ax, (title, sub, state, received) in zip(layout, states):
        draw_ring_panel(ax, n, title, sub, state, received, patches)
    legend = axes[1][0]
    legend.axis("off")
    legend.set_xlim(0, 1)
    legend.set_ylim(0, 1)
    lines = [
        "How to read it",
        "Each box is one rank's copy of one chunk,",
        "split in four slivers, one per rank:",
        "a sliver is coloured when that rank's",
        "gradient is summed into the copy.",
        "",
        "The ring: 0 → 1 → 2 → 3 → 0 (indices mod 4).",
        "Thick border: written in this step.",
        "Σ: the complete sum of the chunk.",
        "",
        "After n−1 = 3 steps of reduce-scatter",
        "rank i holds the sum of chunk i+1; after",
        "3 steps of all-gather every rank holds",
        "every sum. Each rank sends 2(n−1) chunks,",
        "2(n−1)/n of the buffer, whatever n is.",
    ]
    for i, line in enumerate(lines):
        legend.text(0.02, 0.97 - i * 0.068, line, fontsize=8.5 if i else 10,
                    fontweight="bold" if i == 0 else "normal", va="top")
    fig.suptitle("Ring allreduce on 4 ranks (parallel/comm_ring.cpp)", fontsize=13, y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------- DDP buckets

def plot_buckets(path, plt, patches):
    layers = 8
    fwd = [0.5] * layers                              # forward time per layer (schematic)
    bwd = [1.0, 1.0, 1.0, 1.1, 1.1, 1.2, 1.3, 1.4]   # backward of layer 1..8
    buckets = [[8, 7], [6, 5, 4], [3, 2, 1]]          # reverse registration order, bucket 0 small
    ar = [1.15, 1.6, 1.6]                             # allreduce time per bucket
    bucket_colours = ["#9467bd", "#17becf", "#bcbd22"]
    bucket_of = {l: b for b, ls in enumerate(buckets) for l in ls}

    fig, axes = plt.subplots(2, 1, figsize=(12.5, 5.8), sharex=True)
    for ax, overlap in zip(axes, [True, False]):
        t = 0.0
        rows = {"compute": 1.0, "comm": 0.0}
        h = 0.62
        for l in range(1, layers + 1):               # forward, first to last
            ax.add_patch(patches.Rectangle((t, rows["compute"] - h / 2), fwd[l - 1], h,
                                           facecolor="#c7c7c7", edgecolor="white"))
            ax.text(t + fwd[l - 1] / 2, rows["compute"], f"F{l}", ha="center", va="center", fontsize=7.5)
            t += fwd[l - 1]
        backward_start = t
        full_at = {}
        for l in range(layers, 0, -1):               # backward, last to first
            b = bucket_of[l]
            ax.add_patch(patches.Rectangle((t, rows["compute"] - h / 2), bwd[l - 1], h,
                                           facecolor=bucket_colours[b], edgecolor="white"))
            ax.text(t + bwd[l - 1] / 2, rows["compute"], f"B{l}", ha="center", va="center", fontsize=8)
            t += bwd[l - 1]
            if l == min(buckets[b]):
                full_at[b] = t
        backward_end = t
        comm_free = 0.0
        for b in range(len(buckets)):                # launched in bucket order, one at a time
            start = max(full_at[b] if overlap else backward_end, comm_free)
            ax.add_patch(patches.Rectangle((start, rows["comm"] - h / 2), ar[b], h,
                                           facecolor=bucket_colours[b], edgecolor="black", linewidth=0.8))
            ax.text(start + ar[b] / 2, rows["comm"], f"allreduce\nbucket {b}", ha="center",
                    va="center", fontsize=7)
            if overlap:
                ax.plot([full_at[b], full_at[b]], [rows["comm"] + h / 2, rows["compute"] - h / 2],
                        color="black", linestyle=":", linewidth=1)
                ax.text(full_at[b] + 0.06, (rows["comm"] + rows["compute"]) / 2, f"bucket {b} full",
                        fontsize=7, va="center", ha="left", style="italic")
            comm_free = start + ar[b]
        step = max(comm_free, backward_end)
        ax.add_patch(patches.Rectangle((step, rows["compute"] - h / 2), 1.2, h,
                                       facecolor="#8c564b", edgecolor="white"))
        ax.text(step + 0.6, rows["compute"], "optimizer\nstep", ha="center", va="center",
                fontsize=7.5, color="white")
        end = step + 1.2
        ax.annotate("", xy=(end, -0.62), xytext=(0, -0.62),
                    arrowprops=dict(arrowstyle="<->", color="black", linewidth=0.8))
        ax.text(end / 2, -0.72, "one step", ha="center", va="top", fontsize=8)
        ax.set_yticks([rows["comm"], rows["compute"]])
        ax.set_yticklabels(["comm stream", "compute stream"], fontsize=9)
        ax.set_ylim(-1.05, 1.45)
        ax.set_xlim(-0.2, 22.5)
        ax.set_title("buckets allreduced during backward (DDP)" if overlap else
                     "the same buckets after backward (--no-overlap)", fontsize=10.5, loc="left")
        ax.tick_params(axis="x", labelbottom=False, bottom=False)
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
        if overlap:
            ax.text(backward_start, 1.38, "backward: layer 8 first", fontsize=8, va="center")
    handles = [patches.Patch(facecolor="#c7c7c7", label="Fl: forward of layer l")]
    handles += [patches.Patch(facecolor=bucket_colours[b],
                              label=f"Bl: backward of layer l, in bucket {b} (layers {', '.join(map(str, buckets[b]))})")
                for b in range(len(buckets))]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8.5, frameon=False)
    fig.suptitle("DDP: buckets fill in reverse layer order; a full bucket's allreduce "
                 "runs while backward goes on (schematic)", fontsize=11.5)
    fig.tight_layout(rect=(0, 0.09, 1, 0.95))
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------- job topology

def plot_topology(path, plt, patches):
    fig, ax = plt.subplots(figsize=(12.5, 5.9))
    ax.set_xlim(0, 12.5)
    ax.set_ylim(0.1, 6.45)
    ax.axis("off")

    def box(x, y, w, h, face, edge="black", lw=1.0):
        ax.add_patch(patches.FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02",
                                            facecolor=face, edgecolor=edge, linewidth=lw))

    grey, gold, link = "#555555", "#b8860b", "#333333"
    rank_w, rank_y, rank_h = 2.3, 2.2, 2.0
    rank_x = [0.6, 3.5, 6.7, 9.6]
    for n, (x0, name) in enumerate([(0.3, "node 0  (MASTER_ADDR, say 10.0.0.1)"), (6.4, "node 1")]):
        box(x0, 0.95, 5.8, 5.3, "#f4f4f4", edge="#888888", lw=1.2)
        ax.text(x0 + 0.15, 6.02, name, fontsize=10, fontweight="bold", va="center")
        lx = x0 + 2.9
        box(lx - 1.75, 5.05, 3.5, 0.7, "#ffffff")
        ax.text(lx, 5.4, f"tandem-run --nnodes 2 --node-rank {n}\n--nproc-per-node 2 "
                "--master-addr 10.0.0.1", ha="center", va="center", fontsize=8)
        for local in range(2):
            r = 2 * n + local
            ax.annotate("", xy=(rank_x[r] + rank_w / 2, rank_y + rank_h + 0.04), xytext=(lx, 5.03),
                        arrowprops=dict(arrowstyle="-|>", color=grey, linewidth=1))
        ax.text(lx, 4.62, "spawn: RANK, WORLD_SIZE, LOCAL_RANK,\nMASTER_ADDR, MASTER_PORT",
                ha="center", va="center", fontsize=7, color=grey,
                bbox=dict(facecolor="#f4f4f4", edgecolor="none", pad=0.6))
    for r, x in enumerate(rank_x):
        box(x, rank_y, rank_w, rank_h, "#ffffff", edge=RANK_COLOURS[r], lw=2)
        cx = x + rank_w / 2
        ax.text(cx, rank_y + rank_h - 0.3, f"rank {r}", ha="center", fontsize=10.5,
                fontweight="bold", color=RANK_COLOURS[r])
        ax.text(cx, rank_y + rank_h - 0.62, f"LOCAL_RANK {r % 2}, cuda:{r % 2}", ha="center", fontsize=7.5)
        ax.text(cx, rank_y + rank_h - 0.9, "ProcessGroup, DDP", ha="center", fontsize=7.5)
    # the store: a thread in rank 0's process
    sx, sy, sw, sh = rank_x[0] + 0.25, rank_y + 0.15, rank_w - 0.5, 0.62
    ax.add_patch(patches.FancyBboxPatch((sx, sy), sw, sh, boxstyle="round,pad=0.02",
                                        facecolor="#fff2cc", edgecolor=gold, linewidth=1.2))
    ax.text(sx + sw / 2, sy + sh / 2, "TCP store :29500\n(a thread of rank 0)", ha="center",
            va="center", fontsize=7.5)
    # every rank is a client of the store: a dashed bus under the ranks
    bus_y = 1.4
    store_x = sx + sw / 2
    for r in (0, 1, 2, 3):
        cx = rank_x[r] + rank_w / 2 + (0.45 if r == 0 else 0)
        if r:
            ax.plot([cx, cx], [rank_y, bus_y], color=gold, linestyle="--", linewidth=1.3)
    ax.plot([store_x, rank_x[3] + rank_w / 2], [bus_y, bus_y], color=gold, linestyle="--", linewidth=1.3)
    ax.annotate("", xy=(store_x, sy - 0.02), xytext=(store_x, bus_y),
                arrowprops=dict(arrowstyle="-|>", color=gold, linestyle="--", linewidth=1.3))
    ax.text(3.35, bus_y - 0.12, "store clients connect to MASTER_ADDR:MASTER_PORT",
            ha="center", va="top", fontsize=7.5, color=gold)
    # the collective links between neighbours (the ring NCCL or Gloo runs over)
    link_y = rank_y + 0.75
    for a, label in [(0, "NVLink"), (1, "network"), (2, "NVLink")]:
        xa, xb = rank_x[a] + rank_w, rank_x[a + 1]
        ax.annotate("", xy=(xb, link_y), xytext=(xa, link_y),
                    arrowprops=dict(arrowstyle="<|-|>", color=link, linewidth=1.8, shrinkA=0, shrinkB=0))
        ax.text((xa + xb) / 2, link_y + 0.1, label, ha="center", va="bottom", fontsize=7.5, color=link)

    handles = [
        plt.Line2D([], [], color=grey, marker=">", label="launcher: starts its node's workers, "
                   "relays their output, stops all of them when one fails"),
        plt.Line2D([], [], color=gold, linestyle="--", label="store: rendezvous (NCCL's id, Gloo's "
                   "addresses), fingerprints of the first collectives, the abort key"),
        plt.Line2D([], [], color=link, linewidth=1.8, label="the bytes of every collective: NCCL between "
                   "GPUs (NVLink inside a node, the network between nodes), Gloo's TCP pairs between CPU ranks"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.11), ncol=1,
              fontsize=8.5, frameon=False)
    ax.set_title("A job of 4 ranks on two nodes: launchers, ranks, the store, the process group",
                 fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


PICTURES = {"ring_allreduce": plot_ring, "ddp_buckets": plot_buckets, "job_topology": plot_topology}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "..", "docs", "img"))
    ap.add_argument("--only", choices=sorted(PICTURES))
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt
    for name, plot in PICTURES.items():
        if args.only and name != args.only:
            continue
        path = os.path.join(args.out_dir, name + ".png")
        plot(path, plt, patches)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
