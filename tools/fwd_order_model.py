"""A model of the Hopper forward's item order (src/cuda/fwd_item_order.h): schedule balance and the
K / V bytes an LRU L2 would fetch from HBM, per order. docs/notes/2026-12-02-fwd-kv-head-order.md
says what it leaves out (it is a model: the windowed forward's order change of 2026-12-02 was
predicted faster by a model of this kind and measured slower).

    PYTHONPATH=python DUALKV_LIBRARY=build/libdualkv.so python3 tools/fwd_order_model.py \
        [--configs "8,16384,2048;..."] [--orders head:16,kvhead:all,...] [--l2-mib 50,25]

- Items: the library's plan (dualkv_plan_inspect_ex; no window) times H query heads, in the order
  decode_fwd_item gives for (order, window); order head = query-head runs of 1 (main's order with
  window 16), kvhead = runs of the GQA group (the default, with window all).
- Schedule: `--sms` persistent CTAs, each takes the next item when free (the atomic counter); an
  item costs one unit per KV tile of its walk (KvWalk: the ancestors in full, then the own segment
  up to the tile's last query) plus `--overhead` units (Q load, pipeline fill, epilogue).
- L2: LRU over 64 KiB entries (K + V of one 128-row KV tile of one KV head at D 128), touched at the
  step that reads them, in time order over all CTAs; each item's Q tile and output take 64 KiB of
  capacity too. Printed: K / V from HBM against the distinct K / V (compulsory), and the balance
  (mean CTA load / makespan).
"""
from __future__ import annotations

import argparse
import collections
import heapq
import sys

import dualkv
from dualkv import _native

HDR_FWD_OFFSET, FWD_ITEM_INTS = 8, 4  # src/plan_format.h


def forward_tiles(layout, D, sms):
    """The plan's forward tiles (seg, q0, q1) in plan order."""
    info, buf = _native.inspect_plan(layout, D, sms)
    first = buf[HDR_FWD_OFFSET]
    return [tuple(buf[first + i * FWD_ITEM_INTS + j] for j in range(3)) for i in range(info.num_fwd_tiles)]


def decode(item, n_tiles, H, window, head_run):
    """decode_fwd_item of src/cuda/fwd_item_order.h (window already clamped)."""
    w, r = divmod(item, window * H)
    first = w * window
    cnt = min(window, n_tiles - first)
    run, r2 = divmod(r, cnt * head_run)
    t, g = divmod(r2, head_run)
    return first + t, run * head_run + g


def walk(off, parent, s, q1, bn):
    """KV tile start rows of the tile's walk (KvWalk, include/dualkv/mask.h): the ancestors, then each
    own range (one per sibling in a tile of sibling leaves)."""
    ranges = []
    a = parent[s]
    while a >= 0:
        ranges.append((off[a], off[a + 1]))
        a = parent[a]
    x = s
    while x + 1 < len(off) and off[x] < q1:
        ranges.append((off[x], min(off[x + 1], q1)))
        x += 1
    return [k for b, e in ranges for k in range(b, e, bn)]


def model(tiles, off, parent, H, Hk, window, head_run, sms, overhead, caps_mib, bn=128, entry=64 * 2**10):
    n = len(tiles)
    window = max(1, min(window, n))
    walks = [walk(off, parent, s, q1, bn) for s, _, q1 in tiles]
    heap = [(0.0, c) for c in range(sms)]
    events = []  # (time, kind, key): kind 0 = K/V step, 1 = Q/O of an item
    load = 0.0
    group = H // Hk
    for i in range(n * H):
        tile, h = decode(i, n, H, window, head_run)
        t, c = heapq.heappop(heap)
        events.append((t, 1, ("qo", tile, h)))
        for j, k in enumerate(walks[tile]):
            events.append((t + overhead + j, 0, (h // group, k)))
        dur = overhead + len(walks[tile])
        load += dur
        heapq.heappush(heap, (t + dur, c))
    makespan = max(t for t, _ in heap)
    events.sort(key=lambda e: e[0])
    distinct = len({key for _, kind, key in events if kind == 0})
    out = {}
    for cap in caps_mib:
        cap_entries = int(cap * 2**20 // entry)
        lru, misses = collections.OrderedDict(), 0
        for _, kind, key in events:
            if key in lru:
                lru.move_to_end(key)
                continue
            if kind == 0:
                misses += 1
            lru[key] = None
            if len(lru) > cap_entries:
                lru.popitem(last=False)
        out[cap] = misses
    steps = sum(1 for e in events if e[1] == 0)
    return dict(balance=load / sms / makespan, makespan=makespan, steps=steps, distinct=distinct, misses=out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="8,16384,2048;16,8192,2048;28,16384,2048;16,4096,1024")
    ap.add_argument("--orders", default="head:16,kvhead:16,kvhead:33,kvhead:64,kvhead:all,head:64,head:all,kvhead:1")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=1.0)
    ap.add_argument("--l2-mib", default="50,25")
    args = ap.parse_args()
    if args.head_dim > 128:
        sys.exit("the model's 64 KiB entries are K + V tiles of 128 rows at D <= 128")
    H, Hk = args.heads, args.kv_heads
    caps = [float(x) for x in args.l2_mib.split(",")]
    entry = 128 * args.head_dim * 2 * 2
    for cfg in args.configs.split(";"):
        N, P, R = (int(x) for x in cfg.split(","))
        layout = dualkv.Layout.from_groups([P], [[R] * N])
        off, parent = layout.seg_offsets.tolist(), layout.seg_parent.tolist()
        tiles = forward_tiles(layout, args.head_dim, args.sms)
        print(f"== N{N} P{P} R{R}, H {H} Hk {Hk} D {args.head_dim}: {len(tiles)} tiles x {H} heads", flush=True)
        for spec in args.orders.split(","):
            order, win = spec.split(":")
            window = 1 << 30 if win == "all" else int(win)
            head_run = H // Hk if order == "kvhead" else 1
            m = model(tiles, off, parent, H, Hk, window, head_run, args.sms, args.overhead, caps, entry=entry)
            mib = entry / 2**20
            miss = ", ".join(f"L2 {c:g} MiB: {m['misses'][c] * mib:6.0f} MiB ({m['misses'][c] / m['distinct']:.2f}x)"
                             for c in caps)
            print(f"   {spec:10s} balance {m['balance']:.4f}  K/V from HBM: {miss}; compulsory "
                  f"{m['distinct'] * mib:.0f} MiB, steps read {m['steps'] * mib / 1024:.0f} GiB", flush=True)


if __name__ == "__main__":
    main()
