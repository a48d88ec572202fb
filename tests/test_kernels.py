"""The decode-speed machinery of issue 8: CPU few-row kernels, the in-place KV cache and the
fused pure+RAG batch. Each must compute what the stock path computes (to rounding)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tokrag_integrations import generate, generate_batch
from tokrag_integrations.cpu_kernels import (
    ATTN_IMPLEMENTATION,
    few_query_attention,
    install,
    installed,
    maybe_install,
    skinny_linear,
    uninstall,
)
from tokrag_integrations.decoding import ContextSpec, _RoleBatch, fuse_batches
from tokrag_integrations.kv_cache import GrowableLayer

CONTRA = ("What is the capital of France?", ["The capital of France is Marseille."])
FICTION = (
    "What is the name of the cat owned by Zorbin Quell?",
    ["Zorbin Quell owns a grey cat named Pistachio."],
)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 64, 65, 200])
@pytest.mark.parametrize("out_features", [192, 1536])
def test_skinny_linear_equals_linear(rows, out_features):
    torch.manual_seed(rows)
    w = torch.randn(out_features, 576)
    b = torch.randn(out_features)
    x = torch.randn(1, rows, 576)
    for bias in (None, b):
        got = skinny_linear(x, w, bias)
        want = F.linear(x, w, bias)
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    # A column-major input (what an elementwise op on a transposed output gives) too.
    xt = torch.randn(576, rows).t()[None]
    assert torch.allclose(skinny_linear(xt, w, None), F.linear(xt, w), atol=1e-4, rtol=1e-5)


def _sdpa_reference(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 2, 5])
def test_few_query_attention_equals_sdpa_with_masks(q_len):
    torch.manual_seed(q_len)
    b, h, hkv, t, hd = 3, 9, 3, 40, 16
    q = torch.randn(b, h, q_len, hd)
    k = torch.randn(b, hkv, t, hd)
    v = torch.randn(b, hkv, t, hd)
    mask = torch.ones(b, 1, q_len, t, dtype=torch.bool)
    mask[1, :, :, :10] = False  # left padding
    mask[2, :, :, 20:25] = False  # rolled-back holes
    for i in range(q_len):  # causal over the new positions
        mask[:, :, i, t - q_len + i + 1 :] = False
    module = torch.nn.Module()
    module.num_key_value_groups = h // hkv
    got, weights = few_query_attention(module, q, k, v, mask, scaling=0.25)
    assert weights is None and got.shape == (b, q_len, h, hd)
    assert torch.allclose(got, _sdpa_reference(q, k, v, mask, 0.25), atol=1e-5)
    # Additive float masks give the same.
    fmask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    got_f, _ = few_query_attention(module, q, k, v, fmask, scaling=0.25)
    assert torch.allclose(got_f, got, atol=1e-6)
    # A query row with no key at all stays finite (its output is never read).
    dead = mask.clone()
    dead[0] = False
    out, _ = few_query_attention(module, q, k, v, dead, scaling=0.25)
    assert torch.isfinite(out).all()


def test_kernels_installed_on_the_default_cpu_model_and_reversible(lm, monkeypatch):
    assert installed(lm.model) and lm.model.config._attn_implementation == ATTN_IMPLEMENTATION
    x = torch.randn(1, 3, lm.model.config.hidden_size)
    head = lm.model.get_output_embeddings()
    fast = head(x)
    n = uninstall(lm.model)
    try:
        assert n > 0 and not installed(lm.model)
        assert torch.allclose(head(x), fast, atol=1e-3, rtol=1e-4)
    finally:
        install(lm.model)
    assert installed(lm.model)
    monkeypatch.setenv("TOKRAG_CPU_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="TOKRAG_CPU_KERNELS"):
        maybe_install(lm.model)
    monkeypatch.setenv("TOKRAG_CPU_KERNELS", "off")
    assert maybe_install(lm.model) is False


def test_kernels_do_not_change_answers(lm):
    """The stock kernels and ours give the same tokens for rag and tokrag."""
    outs = {}
    for mode in ("fast", "stock"):
        if mode == "stock":
            uninstall(lm.model)
            lm.model.set_attn_implementation("sdpa")
        try:
            outs[mode] = [
                generate(lm, q, ps, policy=p, max_new_tokens=24).token_ids
                for q, ps in (CONTRA, FICTION)
                for p in ("rag", "tokrag")
            ]
        finally:
            if mode == "stock":
                install(lm.model)
                lm.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    assert outs["fast"] == outs["stock"]


def _prefill(lm, prompts, cache_factory=None):
    b = _RoleBatch("rag", list(enumerate(ContextSpec(ids) for ids in prompts)), lm, probe=False)
    if cache_factory is not None:
        b.cache = cache_factory()
    b.forward(None)
    return b


@torch.inference_mode()
def test_growable_cache_equals_dynamic_cache(lm):
    from transformers import DynamicCache

    tok = lm.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("One two three four five six")]
    a = _prefill(lm, prompts)
    b = _prefill(lm, prompts, lambda: DynamicCache(config=lm.model.config))
    assert isinstance(a.cache.layers[0], GrowableLayer)
    assert not isinstance(b.cache.layers[0], GrowableLayer)
    ids = torch.tensor([[11, 12, 13], [21, 22, 23]])
    for step in range(40):  # past the first buffer's spare capacity
        la = a.extend(ids[:, step % 3 : step % 3 + 1])
        lb = b.extend(ids[:, step % 3 : step % 3 + 1])
        assert torch.allclose(la, lb, atol=1e-4)
    assert a.cache.get_seq_length() == b.cache.get_seq_length()
    # Crop, then a copy that advances on its own leaves the original untouched.
    a.cache.crop(-5)
    b.cache.crop(-5)
    a.mask, b.mask = a.mask[:, :-5], b.mask[:, :-5]
    twin = copy.deepcopy(a.cache)
    assert torch.equal(twin.layers[3].keys, a.cache.layers[3].keys)
    before = a.cache.layers[3].keys.clone()
    twin.layers[3].update(torch.ones(2, 3, 1, 64), torch.ones(2, 3, 1, 64))
    assert torch.equal(a.cache.layers[3].keys, before)
    assert torch.allclose(a.extend(ids[:, :2]), b.extend(ids[:, :2]), atol=1e-4)
    # Batch reindexing (beam-search style helpers) keeps working.
    layer = a.cache.layers[0]
    keys = layer.keys.clone()
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys, keys[1:])


@torch.inference_mode()
def test_fused_batch_rows_compute_what_separate_batches_do(lm):
    tok = lm.tokenizer
    short = [tok.encode("Question: who wrote Hamlet?")]
    long = [tok.encode("Context: " + "Shakespeare wrote plays in London. " * 12 + "Question: who wrote Hamlet?")]
    sa, sb = _prefill(lm, short), _prefill(lm, long)
    fa, fb = _prefill(lm, short), _prefill(lm, long)
    fused = fuse_batches([fa, fb])
    assert fused is not None and fused.role == "rag+rag"
    assert fused.pad[0] == len(long[0]) - len(short[0]) and fused.pad[1] == 0
    assert torch.allclose(fused.logits, torch.cat([sa.logits, sb.logits]), atol=1e-4)
    for tid in (464, 318, 257):
        sa.forward(torch.tensor([tid]))
        sb.forward(torch.tensor([tid]))
        fused.forward(torch.tensor([tid, tid]))
        want = torch.cat([sa.logits, sb.logits])
        assert torch.allclose(fused.logits, want, atol=1e-3)
        assert bool((fused.logits.argmax(-1) == want.argmax(-1)).all())
    # Batches probed differently are not fused.
    probed = _RoleBatch("pure", [(0, ContextSpec(short[0]))], lm, probe=True)
    probed.forward(None)
    assert fuse_batches([probed, _prefill(lm, long)]) is None


@pytest.mark.parametrize("policy", ["floor", "cad", "adacad", "tokrag"])
def test_fused_and_unfused_loops_agree(lm, policy, monkeypatch):
    qs, ps = zip(CONTRA, FICTION, strict=True)
    fused = generate_batch(lm, list(qs), list(ps), policy=policy, max_new_tokens=16)
    monkeypatch.setenv("TOKRAG_FUSE_CONTEXTS", "0")
    plain = generate_batch(lm, list(qs), list(ps), policy=policy, max_new_tokens=16)
    for a, b in zip(fused, plain, strict=True):
        assert a.trace.timings.get("fused") == 1.0 and b.trace.timings.get("fused") == 0.0
        assert a.token_ids == b.token_ids
        assert [s.source for s in a.trace.steps] == [s.source for s in b.trace.steps]


@torch.inference_mode()
def test_attention_rows_of_all_layers_equal_the_per_layer_rows(lm):
    from tokrag_integrations.attention import attention_row, attention_rows, cached_keys, model_parts

    tok = lm.tokenizer
    prompts = [tok.encode("Who wrote Hamlet?"), tok.encode("The play Hamlet was written by Shakespeare.")]
    b = _RoleBatch("rag", list(enumerate(ContextSpec(ids) for ids in prompts)), lm, probe=True)
    b.forward(None)
    b.forward(torch.tensor([318, 318]))
    parts = model_parts(lm.model)
    seen = b.mask.shape[1]
    for r in range(2):
        rec = b.records.select([r])
        valid = b.mask[r : r + 1].bool()
        keys = [cached_keys(b.cache, i)[r : r + 1] for i in range(parts.num_layers)]
        got = attention_rows(parts, rec, keys, valid, seen)
        want = torch.stack(
            [attention_row(parts, i, rec, keys[i], valid, seen)[0] for i in range(parts.num_layers)]
        )
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-6)
        assert torch.allclose(got.sum(-1), torch.ones(got.shape[:2]), atol=1e-5)
        assert float(got[..., : b.pad[r]].abs().sum()) == 0.0  # padding gets no attention


def test_left_padding_rows_attend_row_by_row():
    from tokrag_integrations.cpu_kernels import _left_pad_starts

    torch.manual_seed(3)
    b, h, hkv, t, hd = 2, 9, 3, 30, 16
    q = torch.randn(b, h, 1, hd)
    k = torch.randn(b, hkv, t, hd)
    v = torch.randn(b, hkv, t, hd)
    mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
    mask[0, ..., :12] = False
    assert _left_pad_starts(mask) == [12, 0]
    holes = mask.clone()
    holes[1, ..., 5] = False
    assert _left_pad_starts(holes) is None  # not left padding: the masked path
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    for m in (mask, holes):
        got, _ = few_query_attention(module, q, k, v, m, scaling=0.25)
        assert torch.allclose(got, _sdpa_reference(q, k, v, m, 0.25), atol=1e-5)


def test_lazy_chunked_signals_equal_a_full_computation(lm, monkeypatch):
    """The lens is read a few layers at a time, with shared and extra rows; a plain
    computation over every layer must give the same fusion layers, l* and rising token."""
    from tokrag_integrations import signals as S
    from tokrag_integrations.attention import logit_lens
    from tokrag_integrations.policies.tokrag import TokRAG

    seen = []
    orig = TokRAG.signals

    def checked(self, pure, rag):
        out = orig(self, pure, rag)
        parts, L = self._parts, self._L
        attn = torch.stack([rag.attention(i) for i in range(L)])
        f = S.retrieved_attention_mass(attn, rag.rt_positions)
        lens = {
            name: torch.log_softmax(
                logit_lens(parts, v.record.resid[:, 0], final_norm=self.lens_norm), dim=-1
            )
            for name, v in (("pure", pure), ("rag", rag))
        }
        g = (S.layer_shift_jsd(lens["rag"].exp()) - S.layer_shift_jsd(lens["pure"].exp())).abs()
        l_star, fa, gf = S.fusion_layer(f, g, vocab_size=self._A.shape[0], threshold=self.jsd_threshold)
        final = lens["rag"][L] if not self.lens_norm else rag.logits.float()
        rise = S.rising_token(final, lens["rag"][l_star])
        seen.append((out["l_star"], out["fusion_attn_layer"], out["fusion_jsd_layer"], out["rising_token"]))
        assert (out["l_star"], out["fusion_attn_layer"], out["fusion_jsd_layer"]) == (l_star, fa, gf)
        assert out["rising_token"] == self._tok.decode([rise])
        return out

    monkeypatch.setattr(TokRAG, "signals", checked)
    for q, ps in (CONTRA, FICTION):
        for opts in ({}, {"lens_norm": True, "top_k": None}):
            generate(lm, q, ps, policy="tokrag", max_new_tokens=24, **opts)
    assert len(seen) >= 4
    assert len({s[2] for s in seen}) > 1  # crossings in more than one lens chunk
