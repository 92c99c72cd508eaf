"""FA4 dense's forward with and without pack_gqa (its default on sm90 when H > Hk) on the unpacked
batches of issue 23's layouts, against dualkv's forward, in one process: how much of FA4's forward
rate comes from packing a KV head's query heads into one 128-row tile (32 tokens x 4 heads: a finer
causal diagonal and segment end; docs/notes/2026-12-07-fwd-packed-query-heads.md). Interleaved rounds,
CUDA events (bench/attention.py's time_fn), medians. On the device, after tests/gpu/device_run.sh's
fa4-install (PYTHONPATH as it exports):

    python3 tools/fa4_pack_gqa.py 256,128,64 [ROUNDS]
"""
import functools, statistics, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "bench"))
import torch
import attention as A
import layout_classes as lc
import peers

dense0, varlen0 = peers.fa4()
H, Hk, dtype = 32, 8, torch.bfloat16
libraries = {"dualkv": A.Library.default()}
cases = [A.Case(c, *lc.layout_class(c)) for c in ("long_responses", "small_groups", "tree")]
cases.append(A.Case.groups("N8 P16K R2K", [16384], [[2048] * 8]))
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
for D in [int(d) for d in sys.argv[1].split(",")]:
    for case in cases:
        meths = {}
        for label, pack in (("fa4_pack", True), ("fa4_nopack", False)):
            A.fa4 = lambda pack=pack: (functools.partial(dense0, pack_gqa=pack), functools.partial(varlen0, pack_gqa=pack))
            setup, fwd, _, pairs, _ = A.method_fa4_dense(case, H, Hk, D, dtype)
            meths[label] = (fwd, [setup(1000 * i + 17) for i in range(2)], pairs)
        setup, fwd, _, pairs, _ = A.build_method("dualkv", case, H, Hk, D, dtype, libraries)
        meths["dualkv"] = (fwd, [setup(1000 * i + 17) for i in range(2)], pairs)
        times = {k: [] for k in meths}
        names = list(meths)
        for r in range(rounds):
            for k in names[r % len(names):] + names[:r % len(names)]:
                fwd, sets, pairs = meths[k]
                times[k].append(A.time_fn(fwd, sets, 2, 8)[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = statistics.median(a / b for a, b in zip(times["fa4_nopack"], times["fa4_pack"]))
        rd = statistics.median(a / b for a, b in zip(times["dualkv"], times["fa4_pack"]))
        print(f"D{D} {case.name:16s} fwd ms: " + "  ".join(f"{k} {v:.3f} ({4*H*D*meths[k][2]/v/1e9:.0f} TF/s)" for k, v in med.items())
              + f" | nopack/pack {ratio:.3f} | dualkv/pack {rd:.3f}", flush=True)
        del meths
        torch.cuda.empty_cache()
