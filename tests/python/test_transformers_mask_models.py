"""attn_implementation="dualkv" on the models with mask modifiers (issue 16): gpt-oss (sinks +
sliding window on alternate layers), Gemma-2 (logit softcap + window), Gemma-3 and Gemma-4
(sliding:global layers, Gemma-4's global layers at their own head dim, 512 included), Mistral (its
default 4096 window and a small one) and Qwen2 with sliding-window layers. On tiny random configs in
fp32, the packed dualkv model equals the stock model on the unpacked batch: logits of every row,
response log-probs, GRPO loss and every parameter gradient (test_transformers_integration's
assert_packed_equals_unpacked, <= 1e-5). Windows are shorter than the rows, so they cut."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dualkv  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from dualkv.packing import pack  # noqa: E402
from test_transformers_integration import (COMMON, VOCAB, assert_packed_equals_unpacked, build_model,  # noqa: E402
                                          low_precision_logprob_errors, rollouts)

WINDOW = 4  # rows are 8-15 tokens long: responses see only their prompt's tail
SLIDING_FULL = ["sliding_attention", "full_attention"]
# Larger weights than the default init (std 0.02), so that scores reach the softcap's bend and the
# attention patterns (windows, sinks) matter to the outputs.
INIT = dict(initializer_range=0.3)


def make_config(kind: str):
    """The tiny config of ``kind``; skips where the installed transformers lacks the model (Gemma-4
    arrived in 5.x) or the config fields used here."""
    try:
        return _make_config(kind)
    except (AttributeError, TypeError) as e:
        pytest.skip(f"transformers {transformers.__version__} cannot build the {kind} config: {e}")


def _make_config(kind: str):
    c = dict(COMMON, head_dim=8)
    if kind == "gpt_oss":  # layer 0 sliding, layer 1 full (the default alternation); sinks in every layer
        return transformers.GptOssConfig(**c, **INIT, sliding_window=WINDOW, num_local_experts=4,
                                         num_experts_per_tok=2)
    if kind == "gemma2":
        return transformers.Gemma2Config(**c, **INIT, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=None, query_pre_attn_scalar=8,
                                         layer_types=SLIDING_FULL)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(**c, **INIT, sliding_window=WINDOW, query_pre_attn_scalar=8,
                                             final_logit_softcapping=None, layer_types=SLIDING_FULL)
    if kind in ("gemma4", "gemma4_d512"):  # global layers at their own head dim (Gemma-4: 512)
        return transformers.Gemma4TextConfig(**c, **INIT, sliding_window=WINDOW, layer_types=SLIDING_FULL,
                                             global_head_dim=512 if kind == "gemma4_d512" else 16,
                                             vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                                             final_logit_softcapping=None)
    if kind == "mistral_default":  # MistralConfig's default window (4096): inert on these rows
        return transformers.MistralConfig(**c)
    if kind == "mistral":
        return transformers.MistralConfig(**c, sliding_window=WINDOW)
    if kind == "qwen2_swa":  # layers from max_window_layers on slide
        return transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    raise ValueError(kind)


def make_model(kind: str, attn: str, seed: int = 0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_model(make_config(kind), attn, seed)


STOCK = {"gpt_oss": ["eager"], "gemma2": ["eager"], "gemma3": ["eager", "sdpa"], "gemma4": ["eager", "sdpa"],
         "mistral_default": ["sdpa"], "mistral": ["eager", "sdpa"], "qwen2_swa": ["sdpa"]}


@pytest.mark.parametrize("kind,attn", [(k, a) for k, attns in STOCK.items() for a in attns])
def test_packed_equals_unpacked(kind, attn):
    std = make_model(kind, attn)
    assert std.config._attn_implementation == attn
    dk = dkt.enable(copy.deepcopy(std))
    assert dkt.is_enabled(dk)
    assert_packed_equals_unpacked(std, dk, *rollouts())


def test_gemma4_global_layers_at_head_dim_512():
    """Gemma-4 with its global layers at head dim 512 (sliding layers at 8). Gemma-4's scores are
    q- and k-normed and unscaled (scaling 1.0): at D = 512 they spread over +-20, where fp32 itself
    is ~1e-5 off in the gradients (the stock fp32 model against its fp64 twin, dualkv likewise). The
    q-norm weights are scaled by 1/4 here, so that fp32 agrees with fp64 and the 1e-5 comparison
    against the stock fp32 model means what it does for the other models."""
    std = make_model("gemma4_d512", "sdpa")
    assert {layer.self_attn.head_dim for layer in std.model.layers} == {8, 512}
    with torch.no_grad():
        for layer in std.model.layers:
            layer.self_attn.q_norm.weight.mul_(0.25)
    dk = dkt.enable(copy.deepcopy(std))
    assert_packed_equals_unpacked(std, dk, *rollouts())


def test_the_modifiers_matter():
    """The equivalences above are not vacuous: without its window (gpt-oss) or its softcap (Gemma-2)
    the same packed model gives other logits on these rows."""
    packed = pack(*rollouts())
    for kind, attr in (("gpt_oss", "sliding_window"), ("gemma2", "attn_logit_softcapping")):
        dk = dkt.enable(make_model(kind, "eager"))
        a = dk(**dkt.model_inputs(packed)).logits
        for layer in dk.model.layers:  # each layer holds its own copy of the config value
            setattr(layer.self_attn, attr, None)
        b = dk(**dkt.model_inputs(packed)).logits
        assert (a - b).abs().max() > 1e-3, kind


def test_config_modifiers_and_checks():
    assert dkt.config_modifiers(make_config("gpt_oss")) == {"window": WINDOW, "sinks": None}
    assert dkt.config_modifiers(make_config("gemma2")) == {"window": WINDOW, "softcap": 2.0}
    assert dkt.config_modifiers(make_config("mistral_default")) == {"window": 4096}
    assert dkt.config_modifiers(transformers.Qwen2Config(**COMMON)) == {}  # window value, no sliding layer
    assert dkt.config_modifiers(transformers.LlamaConfig(**COMMON)) == {}
    # the published default configs are accepted (Gemma-2's final softcap warns: log-probs from logits)
    dkt.check_config(transformers.GptOssConfig())
    dkt.check_config(transformers.Gemma3TextConfig())
    dkt.check_config(transformers.MistralConfig())
    with pytest.warns(UserWarning, match="final logits"):
        dkt.check_config(transformers.Gemma2Config())
    with pytest.raises(dualkv.UnsupportedError, match="non-causal"):
        dkt.check_config(transformers.Gemma3TextConfig(use_bidirectional_attention=True))
    if hasattr(transformers, "Gemma4TextConfig"):
        dkt.check_config(transformers.Gemma4TextConfig())
        with pytest.raises(dualkv.UnsupportedError, match="non-causal"):
            dkt.check_config(transformers.Gemma4TextConfig(use_bidirectional_attention="all"))
    bad = make_config("mistral")
    bad.sliding_window = 0
    with pytest.raises(dualkv.ArgumentError, match="sliding_window=0"):
        dkt.check_config(bad)


def test_backend_without_the_modifiers_is_refused_before_the_forward(monkeypatch):
    """On a device whose backend lacks a modifier of the model (the CUDA backend has none yet),
    enable() and the guard raise UnsupportedError naming them before the model computes anything;
    simulated here by a CPU backend that reports no modifiers."""
    from dualkv import _native
    model = make_model("gpt_oss", "eager")
    monkeypatch.setattr(_native, "_info", dict(_native.build_info(), cpu={"modifiers": []}))
    with pytest.raises(dualkv.UnsupportedError, match="CPU backend does not implement.*window 4, sinks"):
        dkt.enable(copy.deepcopy(model))
    monkeypatch.undo()
    dk = dkt.enable(model)
    packed = pack(*rollouts())
    monkeypatch.setattr(_native, "_info", dict(_native.build_info(), cpu={"modifiers": ["window"]}))
    calls = []
    dk.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(dualkv.UnsupportedError, match="sinks"):
        dk(**dkt.model_inputs(packed))
    assert not calls  # refused before the embedding ran


def test_dense_reference_implementation_with_modifiers():
    """attn_implementation="dualkv_reference" applies the same modifiers (dense mask with the window,
    the reference attention for softcap and sinks) and equals "dualkv"."""
    for kind in ("gpt_oss", "gemma2"):
        dk = dkt.enable(make_model(kind, "eager"))
        ref = dkt.enable(copy.deepcopy(dk), reference=True)
        packed = pack(*rollouts())
        a = dk(**dkt.model_inputs(packed)).logits
        b = ref(**dkt.model_inputs(packed)).logits
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_modifiers_under_sequence_parallelism_are_refused():
    from dualkv.distributed import SequenceShard
    from dualkv.integrations.transformers import dualkv_attention_forward
    layout = pack(*rollouts()).layout
    shard = SequenceShard(None, layout, None, 1, 0, None, layout.position_ids.view(1, -1))  # a group of one
    q = torch.randn(1, 4, layout.num_tokens, 8)
    k = torch.randn(1, 2, layout.num_tokens, 8)
    with pytest.raises(dualkv.UnsupportedError, match="not supported under sequence parallelism"):
        dualkv_attention_forward(torch.nn.Module(), q, k, k, None, sliding_window=4, dualkv_layout=shard)
    dualkv_attention_forward(torch.nn.Module(), q, k, k, None, dualkv_layout=shard)  # without: runs


@pytest.mark.parametrize("kind", ["gpt_oss", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tolerance_rule(kind, dtype):
    """bf16 / fp16 with the modifiers (window + sinks, window + softcap): the packed dualkv model's
    log-prob error against the fp32 truth is at most 2x the stock unpacked model's in the same dtype,
    plus 1e-3 (test_transformers_integration's rule)."""
    err_dk, err_std = low_precision_logprob_errors(make_model(kind, "eager"), dtype)
    assert err_dk <= 2 * err_std + 1e-3, (err_dk, err_std)


class _DenseMLP(torch.nn.Module):
    """A stand-in for gpt-oss's MoE block, with its (hidden, router scores) return: the grouped-mm
    experts of transformers before 5.2x guard on routed sizes in their backward and cannot be traced
    with fullgraph=True (transformers 5.17 on the H200), which has nothing to do with attention."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return torch.nn.functional.silu(self.proj(x)), None


def test_torch_compile_fullgraph_with_window_and_sinks():
    """gpt-oss (a window on one layer, sinks on both) compiles with fullgraph=True (aot_eager, as the
    other model's compile test): the modifiers' checks trace without a graph break; outputs and
    gradients equal eager mode."""
    torch._dynamo.reset()
    eager = dkt.enable(make_model("gpt_oss", "eager"))
    torch.manual_seed(0)
    for layer in eager.model.layers:
        layer.mlp = _DenseMLP(eager.config.hidden_size)
    comp = copy.deepcopy(eager)
    compiled = torch.compile(comp, backend="aot_eager", fullgraph=True)
    packed = pack(*rollouts())
    a = eager(**dkt.model_inputs(packed)).logits
    b = compiled(**dkt.model_inputs(packed)).logits
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(eager.named_parameters(), comp.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("kind", ["gpt_oss", "gemma3"])
def test_packed_forward_serves_windowed_models(kind):
    """The packed log-prob path of TRL / veRL (_packed_forward) on models with sliding-window layers
    (and sinks): the log-probs and entropies of the backend's own packed path (tested against the
    stock model above), and gradients that reach the parameters."""
    from dualkv.integrations._packed_forward import check_servable, forward_kwargs, install
    from dualkv.logprobs import response_logprobs
    model = dkt.enable(make_model(kind, "eager"))
    check_servable(model, torch.device("cpu"))
    install(model)
    packed = pack(*rollouts())
    out = model(**forward_kwargs(packed, 1.0, True))
    hidden = model.model(**dkt.model_inputs(packed)).last_hidden_state
    want_lp, want_ent = response_logprobs(hidden[0], model.lm_head.weight, packed, entropy=True)
    torch.testing.assert_close(out.log_probs, want_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.entropy, want_ent, rtol=0, atol=1e-6)
    out.log_probs.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "self_attn" in n)


def test_packed_forward_checks_gemma4_global_head_dim(monkeypatch):
    """The packed log-prob path checks every head dim of the model: Gemma-4's global layers have
    their own (16 here, 8 on its sliding layers), refused by a backend whose limit is 8."""
    from dualkv.integrations import _packed_forward
    model = make_model("gemma4", "sdpa")
    _packed_forward.check_servable(model, torch.device("cpu"))
    info = dualkv.build_info()
    monkeypatch.setattr(_packed_forward, "build_info", lambda: dict(info, cpu=dict(info["cpu"], max_head_dim=8)))
    with pytest.raises(dualkv.UnsupportedError, match="head dim 16"):
        _packed_forward.check_servable(model, torch.device("cpu"))
