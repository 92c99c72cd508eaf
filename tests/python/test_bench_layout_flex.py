"""bench/layout_flex.py: Flex-FA4 packing as a dualkv layout attention, the flex_fa4 method of
bench/verl_step.py and bench/trl_step.py (on a CPU, the project's dense-mask stand-in of Flex)."""
import pytest
import torch


def test_flex_fa4_attention_builds_one_mask_per_layout():
    """Flex-FA4's layout attention on a CPU (the dense-mask stand-in): the forest rule of a packed layout
    equals dualkv's visibility (against dualkv_reference, GQA); the BlockMask is built once per layout
    however many calls (layers, recompute) read it, again for a new layout; a missing layout, a prompt
    phase's keys and values and a mask modifier are refused."""
    from test_demo import _load_bench

    import dualkv
    from dualkv.integrations import transformers as dkt
    bench = _load_bench("layout_flex")
    g = torch.Generator().manual_seed(2)
    layouts = [dualkv.pack([torch.arange(5), torch.arange(3)], [[torch.arange(2), torch.arange(4)], [torch.arange(3)]])
               .layout for _ in range(2)]
    attn = bench.ForestFlexAttention("FLASH")
    attn.recorded = []
    for layout in (layouts[0], layouts[0], layouts[1], layouts[0]):
        T = layout.num_tokens
        q = torch.randn(1, 4, T, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(2))
        out, weights = attn(None, q, k, v, None, scaling=0.3, dualkv_layout=layout)
        want, _ = dkt.dense_reference_attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.3,
                                                        dualkv_layout=layout)
        assert weights is None and out.shape == (1, T, 4, 8)
        torch.testing.assert_close(out, want)
    assert attn.recorded == layouts  # one build per layout, in order
    with pytest.raises(dkt.MissingLayoutError, match="dualkv_layout"):
        attn(None, q, k, v, None)
    with pytest.raises(dualkv.UnsupportedError, match="DUALKV_VERL_PROMPT_ONCE=0"):
        attn(None, q, k, v, None, dualkv_layout=layouts[0], dualkv_prompt_kv=object())
    with pytest.raises(dualkv.UnsupportedError, match="sliding_window"):
        attn(None, q, k, v, None, dualkv_layout=layouts[0], sliding_window=4)
