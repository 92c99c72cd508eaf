"""Host time per call of the dualkv attention op (us/call), on a problem so small that the kernel
costs ~nothing: what is left is the Python, ctypes, custom-op and library-entry work of one call.

    PYTHONPATH=python python bench/op_host_overhead.py --device cpu     # CPU backend (this host)
    PYTHONPATH=python python bench/op_host_overhead.py --device cuda    # the H200

Three loops, each timed between two device synchronisations (CUDA: the GPU runs behind; with
tiny kernels the host is the bottleneck, so wall time / calls is the host time per call):

* ``fwd``: ``dualkv.attention`` forward, inputs without grad (no autograd node);
* ``fwd+bwd``: forward with grad and ``out.backward`` (one fwd and one bwd op, plus autograd);
* ``layer``: the transformers integration's per-layer attention function
  (``dualkv_attention_forward``) on [1, H, T, D] inputs with grad, forward only (what each decoder
  layer calls).

* ``model``: one forward+backward step of a tiny Qwen3 (``--layers``, gradient checkpointing) on
  the packed batch: the op's host time among everything else of a training step.

Each op loop is also given "over library": its time minus that of the bare C calls (``dualkv_fwd`` /
``dualkv_bwd`` on params built once; their entry checks and the kernels), i.e. the host work the
Python layer adds per call.

``--profile`` prints the cProfile of the fwd+bwd loop (cumulative, top 30 entries).
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import pstats
import time

import torch

import dualkv
from dualkv.integrations import transformers as dkt


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, calls: int, repeats: int, warmup: int = 20) -> float:
    """us per call: the best of ``repeats`` loops of ``calls`` calls (a shared host's noise only adds)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter_ns() - start) / calls / 1e3)
    return best


def _set_workspace(params, ws):
    """Points the params at workspace ``ws`` (None or empty: none); returns it (held by the caller)."""
    used = ws is not None and ws.numel()
    params.workspace, params.workspace_bytes = (ws.data_ptr(), ws.numel()) if used else (None, 0)
    return ws


def _library_calls(q, k, v, layout, grad):
    """(fwd, bwd): the bare C calls of one forward and one backward with their params built once:
    the library's own entry checks, dispatch and kernel, the floor under the op's host time."""
    from dualkv import _native, ops
    lib = _native.lib()
    plan, key = layout.plan_for(q.dtype, q.shape[-1])
    scale = q.shape[-1] ** -0.5
    out, lse = ops._fwd(q, k, v, layout.meta, plan, layout.num_segments, layout.max_depth, key, scale, False)
    keep = []

    def params(cls, query):
        p = cls()
        ops._fill_common(p, q, k, v, layout.meta, plan, layout.num_segments, layout.max_depth, key, scale, False,
                         None, None, 0, 0, 0.0, None)
        return p

    f = params(_native.FwdParams, lib.dualkv_fwd_workspace_size)
    o2, l2 = torch.empty_like(out), torch.empty_like(lse)
    f.out, f.out_token_stride, f.out_head_stride = o2.data_ptr(), o2.stride(0), o2.stride(1)
    f.lse, f.lse_head_stride = l2.data_ptr(), l2.stride(0)
    keep += [o2, l2, _set_workspace(f, ops._workspace(lib.dualkv_fwd_workspace_size, f, q.device))]
    b = params(_native.BwdParams, lib.dualkv_bwd_workspace_size)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for name, t in (("out", out), ("dout", grad), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
        setattr(b, name, t.data_ptr())
        setattr(b, f"{name}_token_stride", t.stride(0))
        setattr(b, f"{name}_head_stride", t.stride(1))
    b.lse, b.lse_head_stride = lse.data_ptr(), lse.stride(0)
    keep += [out, lse, grads, _set_workspace(b, ops._workspace(lib.dualkv_bwd_workspace_size, b, q.device))]
    fwd = lambda: _native.check(lib.dualkv_fwd(ctypes.byref(f)), "fwd")  # noqa: E731
    bwd = lambda: _native.check(lib.dualkv_bwd(ctypes.byref(b)), "bwd")  # noqa: E731
    fwd.keep = bwd.keep = keep
    return fwd, bwd


def _tiny_qwen3(device, dtype, layers: int, H: int, Hk: int, D: int):
    """A random Qwen3 of ``layers`` decoder layers, hidden size H*D, dualkv attention, gradient
    checkpointing (non-reentrant, as the GRPO runs): every layer calls the op twice in the forward
    (the recompute) and once in the backward."""
    import warnings

    import transformers
    config = transformers.Qwen3Config(hidden_size=H * D, intermediate_size=H * D, num_hidden_layers=layers,
                                      num_attention_heads=H, num_key_value_heads=Hk, head_dim=D, vocab_size=96,
                                      max_position_embeddings=128, attention_dropout=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype)
    dkt.enable(model.train())
    with warnings.catch_warnings():  # transformers 5 renames it (activation_checkpointing_enable)
        warnings.simplefilter("ignore", FutureWarning)
        dkt.enable_checkpointing(model)
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=28, help="decoder layers of the tiny Qwen3 (the 'model' loop)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.set_num_threads(1)

    layout = dualkv.Layout.from_groups([8], [[8, 8, 8]]).to(device)  # T = 32
    T, H, Hk, D = layout.num_tokens, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g).to(device, dtype)
    k = torch.randn(T, Hk, D, generator=g).to(device, dtype)
    v = torch.randn(T, Hk, D, generator=g).to(device, dtype)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    grad = torch.randn(T, H, D, generator=g).to(device, dtype)

    def fwd():
        dualkv.attention(q, k, v, layout)

    def fwd_bwd():
        dualkv.attention(qg, kg, vg, layout).backward(grad)

    model = _tiny_qwen3(device, dtype, args.layers, H, Hk, D)
    module = model.model.layers[0].self_attn  # the attention function reads its config and scaling
    query = qg.detach().transpose(0, 1).unsqueeze(0).requires_grad_()  # [1, H, T, D] (stride as transformers')
    key = kg.detach().transpose(0, 1).unsqueeze(0).requires_grad_()
    value = vg.detach().transpose(0, 1).unsqueeze(0).requires_grad_()

    def layer():
        dkt.dualkv_attention_forward(module, query, key, value, None, dualkv_layout=layout)

    g = torch.Generator().manual_seed(1)
    packed = dualkv.pack([torch.randint(0, 96, (8,), generator=g)],
                         [[torch.randint(0, 96, (8,), generator=g) for _ in range(3)]]).to(device)
    inputs = dkt.model_inputs(packed)

    def model_step():
        model(**inputs).logits.float().sum().backward()

    lib_fwd, lib_bwd = _library_calls(q, k, v, layout, grad)
    print(f"device {device}, {dtype}, T {T}, H {H}, Hk {Hk}, D {D}, torch {torch.__version__}; us per call, best "
          f"of {args.repeats} x {args.calls}; 'over library': minus the bare C calls (kernels included)")
    base = {name: _time(fn, device, args.calls, args.repeats) for name, fn in (("fwd", lib_fwd), ("bwd", lib_bwd))}
    print(f"{'library fwd':12s} {base['fwd']:8.1f}\n{'library bwd':12s} {base['bwd']:8.1f}")
    for name, fn, floor in (("fwd", fwd, base["fwd"]), ("fwd+bwd", fwd_bwd, base["fwd"] + base["bwd"]),
                            ("layer", layer, base["fwd"])):
        t = _time(fn, device, args.calls, args.repeats)
        print(f"{name:12s} {t:8.1f}   over library {t - floor:8.1f}")
    step = _time(model_step, device, max(args.calls // (20 * args.layers), 3), args.repeats, warmup=2)
    print(f"{'model':12s} {step / 1e3:8.2f} ms per fwd+bwd step of a {args.layers}-layer Qwen3 with gradient "
          f"checkpointing ({3 * args.layers} op calls)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fwd_bwd()
        prof.disable()
        _sync(device)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
