"""The static step's forward written out (``accel/static_forward.py``, ``direct=True``) against
the layers' own forwards (``direct=False``): the same operations in the same order, so the
logits, the residuals and the attention probabilities are bit-equal, and the key / value
columns written are the same. On the packaged SmolLM2 and on random two-layer Llama,
Mistral, Qwen2 and Qwen3 models (Qwen3: the per-head q / k norms); and the cases the
written-out layers refuse (a hook, another layer class)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokrag_integrations import generate
from tokrag_integrations.accel.static_forward import (
    ATTN_STATIC,
    direct_off_reason,
    register_attention,
    static_forward,
)

COLUMNS = 24


def _random(kind: str) -> torch.nn.Module:
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
    )
    torch.manual_seed(1)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, attention_bias=True))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16))


def _run(model: torch.nn.Module, direct: bool, rows: int = 2) -> tuple:
    """Both paths on the same random state: (logits, resid, attn, keys, values)."""
    register_attention()
    cfg = model.config
    layers = cfg.num_hidden_layers
    n_kv = cfg.num_key_value_heads
    hd = model.model.layers[0].self_attn.head_dim
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(rows, n_kv, COLUMNS, hd, generator=g).to(dtype) for _ in range(layers)]
    values = [torch.randn(rows, n_kv, COLUMNS, hd, generator=g).to(dtype) for _ in range(layers)]
    valid = torch.zeros(rows, COLUMNS, dtype=torch.bool)
    valid[0, 3:10] = True
    valid[-1, 6:10] = True  # left padding: the rows start at different columns
    col = torch.tensor(10)
    valid[:, 10] = True  # as the step does: every row sees the column it writes
    ids = torch.tensor([5, 17, 200, 42][:rows])
    pos = torch.tensor([7, 4, 9, 1][:rows])
    before = cfg._attn_implementation
    cfg._attn_implementation = ATTN_STATIC
    try:
        with torch.inference_mode():
            out = static_forward(
                model, ids, pos, valid, col, keys, values, resid=True, attn=True, direct=direct
            )
    finally:
        cfg._attn_implementation = before
    return (*out, keys, values)


def _bit_equal(model: torch.nn.Module) -> None:
    assert direct_off_reason(model) is None
    want, got = _run(model, direct=False), _run(model, direct=True)
    for name, w, g in zip(("logits", "resid", "attn"), want[:3], got[:3], strict=True):
        assert torch.equal(w, g), name
    for w, g in zip(want[3] + want[4], got[3] + got[4], strict=True):
        assert torch.equal(w, g)  # the same key / value columns written


def test_the_written_out_layers_equal_the_packaged_models_own(lm):
    _bit_equal(lm.model)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_written_out_layers_equal_each_architectures_own(kind):
    _bit_equal(_random(kind).eval())


def test_a_hook_or_another_layer_keeps_the_layers_own_forwards():
    model = _random("llama").eval()
    seen = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: seen.append(1))
    try:
        assert direct_off_reason(model) == "a forward hook on the model"
    finally:
        handle.remove()
    assert direct_off_reason(model) is None

    class OtherLayer(torch.nn.Module):
        pass

    model.model.layers[0] = OtherLayer()
    assert direct_off_reason(model) == "decoder layer OtherLayer"


def test_a_hooked_model_decodes_through_its_layers_and_runs_the_hook(lm):
    """A forward hook on a layer's module keeps the module calls: it runs at every step."""
    calls = []
    handle = lm.model.model.layers[0].mlp.register_forward_hook(lambda *a: calls.append(1))
    try:
        r = generate(lm, "What is the capital of France?", ["Paris is the capital of France."],
                     policy="rag", speed="cuda", max_new_tokens=4, citations=None)  # fmt: skip
    finally:
        handle.remove()
    assert r.trace.timings["static"] == 1.0
    assert len(calls) >= len(r.trace.steps)  # the prefill and every step ran it
