"""A model of the Hopper D-128 forward on GRPO layouts (one prompt, N responses): the work per item,
the tail of the persistent schedule, and what 160-row KV tiles change. Self-contained (the plan's
tiling rules restated: 128-row query tiles per segment, longest walk first; no library needed).
docs/notes/2026-12-02-fwd-long-layouts.md has the numbers and what the model leaves out.

    python3 tools/fwd_tile_width_model.py [--configs "16,4096,1024;8,16384,2048"] [--phi 0.10,0.15,0.20]

- A tile of the walk costs phi + (1 - phi) * (its computed columns / 128) units: phi is the part of
  a 128-row tile's time that does not grow with the tile's width (row max / sum shuffles, the O
  rescale, mbarrier and named-barrier waits, the ping-pong hand-off); the rest is the matrix products
  and the per-element softmax, which grow with it. A tile computes all of its columns (the wgmma's N)
  even when fewer keys are left in the range. An item also costs `--item` units (Q load, first
  and last products without overlap, epilogue).
- Walks: base = KvWalk<128> (fwd_kernel.cuh today); wide = KvWalk<160> (the change);
  mixed = 160-row tiles on the unmasked stretches and 128-row ones on the diagonal and the stretch
  remainders, with S always 160 wide and P V cut to 128 on the narrow tiles (what a kernel can issue
  without branching between wgmma shapes; ptxas serialises the wgmmas when S's shape is a branch);
  ideal = the same walk with both products narrow on narrow tiles (not buildable as said).
- Schedule: --sms CTAs take the items (tiles x H heads) longest first from one counter (the plan's
  order; the KV-head-major order has the same lengths in the same order per KV head). Printed: the
  balance (mean CTA busy time / makespan) and the idle time at the tail, which is all a split of
  the longest items could win.
- --measured "N,P,R=TF/s;...": converts a measured useful TF/s into µs per computed 128x128
  iteration (KV tile x 128 query rows), to compare layouts per unit of work.
"""
from __future__ import annotations

import argparse
import heapq

BM = 128


def grpo_layout(P, N, R):
    """(offsets, parents, tiles): segment 0 the prompt, 1..N the responses; tiles (seg, q0, q1)."""
    off = [0, P] + [P + (i + 1) * R for i in range(N)]
    parent = [-1] + [0] * N
    tiles = [(s, q0, min(q0 + BM, off[s + 1])) for s in range(N + 1) for q0 in range(off[s], off[s + 1], BM)]
    return off, parent, tiles


def walk_tiles(off, parent, s, q0, q1, mode):
    """(S columns, P V columns, keys) of each KV tile of the walk of query tile [q0, q1) of segment s."""
    stretches = []  # (begin, end, narrow_rest): narrow_rest = the stretch's last <= 128 keys go narrow
    a = parent[s]
    while a >= 0:
        stretches.append((off[a], off[a + 1]))
        a = parent[a]
    if mode in ("base", "wide"):
        stretches.append((off[s], q1))
    else:
        stretches += [(off[s], q0), (q0, q1)]
    out = []
    for b, e in stretches:
        p = b
        while p < e:
            rest = e - p
            if mode == "base":
                n = min(rest, 128)
                out.append((128, 128, n))
            elif mode == "wide":
                n = min(rest, 160)
                out.append((160, 160, n))
            else:
                narrow = rest <= 128
                n = rest if narrow else min(rest, 160)
                if mode == "mixed":
                    out.append((160, 128 if narrow else 160, n))
                else:  # ideal
                    out.append((128, 128, n) if narrow else (160, 160, n))
            p += n
    return out


def item_costs(P, N, R, mode, phi, item):
    off, parent, tiles = grpo_layout(P, N, R)
    c = (1.0 - phi) / 128.0
    costs, cols, keys, ntiles = [], 0, 0, 0
    for s, q0, q1 in tiles:
        w = walk_tiles(off, parent, s, q0, q1, mode)
        costs.append(sum(phi + c * (a + b) / 2 for a, b, _ in w) + item)
        cols += sum((a + b) / 2 for a, b, _ in w)
        keys += sum(n for _, _, n in w)
        ntiles += len(w)
    return costs, cols, keys, ntiles


def schedule(costs, H, sms):
    order = sorted(costs, reverse=True)
    heap = [0.0] * sms
    total = 0.0
    for cst in order:
        for _ in range(H):
            t = heapq.heappop(heap)
            heapq.heappush(heap, t + cst)
            total += cst
    makespan = max(heap)
    return makespan, total / sms / makespan


def useful_flops(P, N, R, H, D):
    pairs = P * (P + 1) // 2 + N * (R * P + R * (R + 1) // 2)
    return 4.0 * D * pairs * H


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="16,4096,1024;16,8192,2048;8,16384,2048;28,16384,2048;32,8192,1024")
    ap.add_argument("--phi", default="0.10,0.15,0.20")
    ap.add_argument("--item", type=float, default=1.0, help="fixed cost per item, in 128-tile units")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--measured", default="16,4096,1024=641.8;8,16384,2048=597.0")
    args = ap.parse_args()
    H = args.heads
    phis = [float(x) for x in args.phi.split(",")]
    print("== the work (per query head) and the tail (phi 0.15)")
    for cfg in args.configs.split(";"):
        N, P, R = (int(x) for x in cfg.split(","))
        costs, cols, keys, ntiles = item_costs(P, N, R, "base", 0.15, args.item)
        mk, bal = schedule(costs, H, args.sms)
        n_items = len(costs) * H
        longest = max(costs)
        print(f"N{N} P{P} R{R}: {n_items} items, {ntiles} KV tiles per head (mean {ntiles / len(costs):.1f} per item, "
              f"longest {longest - args.item:.0f}), {n_items / args.sms:.1f} items per CTA; balance {bal:.4f}: the "
              f"tail idles {100 * (1 - bal):.2f}% of the CTA time (the most a split of the longest items can win)")
    print("\n== computed columns against keys (walk waste), and time against base by phi")
    for cfg in args.configs.split(";"):
        N, P, R = (int(x) for x in cfg.split(","))
        base_cols = item_costs(P, N, R, "base", 0.15, args.item)[1]
        line = []
        for mode in ("wide", "mixed", "ideal"):
            _, cols, keys, ntiles = item_costs(P, N, R, mode, 0.15, args.item)
            line.append(f"{mode}: columns x{cols / base_cols:.4f}, tiles {ntiles}")
        print(f"N{N} P{P} R{R}: base tiles {item_costs(P, N, R, 'base', 0.15, args.item)[3]}; " + "; ".join(line))
        for phi in phis:
            base_mk = schedule(item_costs(P, N, R, "base", phi, args.item)[0], H, args.sms)[0]
            ratios = []
            for mode in ("wide", "mixed", "ideal"):
                mk = schedule(item_costs(P, N, R, mode, phi, args.item)[0], H, args.sms)[0]
                ratios.append(f"{mode} {mk / base_mk:.4f}")
            print(f"   phi {phi:.2f}: time / base  " + "  ".join(ratios))
    if args.measured:
        print("\n== measured useful TF/s as µs per computed 128 x 128 iteration (132 SMs, base walk)")
        for spec in args.measured.split(";"):
            cfg, tf = spec.split("=")
            N, P, R = (int(x) for x in cfg.split(","))
            _, cols, keys, ntiles = item_costs(P, N, R, "base", 0.15, args.item)
            t = useful_flops(P, N, R, H, 128) / (float(tf) * 1e12)
            iters = ntiles * H  # 128 x 128 iterations (every base tile computes 128 columns)
            n_tiles_q = len(grpo_layout(P, N, R)[2])
            print(f"N{N} P{P} R{R} at {tf} TF/s: {t * 1e3:.3f} ms, {t * 1e6 * args.sms / iters:.3f} µs per iteration, "
                  f"{ntiles / n_tiles_q:.1f} iterations per item")


if __name__ == "__main__":
    main()
