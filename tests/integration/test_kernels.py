"""The decode-speed machinery of issue 8: CPU few-row kernels, the in-place KV cache and the
fused pure+RAG batch. Each must compute what the stock path computes (to rounding).

Cases that need no model, database or server are in ``tests/unit/test_kernels.py``."""

from __future__ import annotations

import copy

import pytest
import torch

from tokrag_integrations import generate, generate_batch
from tokrag_integrations.accel import cpu_kernels as K
from tokrag_integrations.accel import packed_head as PH
from tokrag_integrations.accel.cpu_kernels import install, installed, uninstall
from tokrag_integrations.accel.install import maybe_install
from tokrag_integrations.accel.packed import fuse_batches
from tokrag_integrations.accel.sdpa import ATTN_IMPLEMENTATION
from tokrag_integrations.contexts.batch import RoleBatch as _RoleBatch
from tokrag_integrations.contexts.kv_cache import GrowableLayer
from tokrag_integrations.contexts.prefill import prefill_roles
from tokrag_integrations.policies.base import ContextSpec

CONTRA = ("What is the capital of France?", ["The capital of France is Marseille."])
FICTION = (
    "What is the name of the cat owned by Zorbin Quell?",
    ["Zorbin Quell owns a grey cat named Pistachio."],
)


def test_kernels_installed_on_the_default_cpu_model_and_reversible(lm, monkeypatch):
    # The attention path always; the linear plans as measured on this machine.
    assert lm.model.config._attn_implementation == ATTN_IMPLEMENTATION
    plans = K.model_plans(lm.model)
    assert "49152x576" in plans and all(set(p) <= set(K.STRATEGIES) for p in plans.values())
    had = installed(lm.model)
    assert had == any(any(s != "linear" for s in p) for p in plans.values())
    x = torch.randn(1, 3, lm.model.config.hidden_size)
    head = lm.model.get_output_embeddings()
    before = head(x)
    uninstall(lm.model)
    try:
        assert not installed(lm.model)
        assert torch.allclose(head(x), before, atol=1e-3, rtol=1e-4)
        assert install(lm.model, "on") > 0 and installed(lm.model)  # forced transposed path
        assert torch.allclose(head(x), before, atol=1e-3, rtol=1e-4)
    finally:
        uninstall(lm.model)
        install(lm.model, "auto")
    assert installed(lm.model) == had
    with pytest.raises(ValueError, match="cpu_kernels must be 'auto', 'on' or 'off'"):
        maybe_install(lm.model, "sometimes")
    assert maybe_install(lm.model, "off") is False


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
                install(lm.model, "auto")
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
        a.forward(ids[:, step % 3])
        b.forward(ids[:, step % 3])
        assert torch.allclose(a.logits, b.logits, atol=1e-4)
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
    for j in range(2):
        a.forward(ids[:, j])
        b.forward(ids[:, j])
        assert torch.allclose(a.logits, b.logits, atol=1e-4)
    # Batch reindexing (beam-search style helpers) keeps working.
    layer = a.cache.layers[0]
    keys = layer.keys.clone()
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys, keys[1:])


@torch.inference_mode()
def test_fused_batch_rows_compute_what_separate_batches_do(lm):
    tok = lm.tokenizer
    short = [tok.encode("Question: who wrote Hamlet?")]
    long = [
        tok.encode(
            "Context: " + "Shakespeare wrote plays in London. " * 12 + "Question: who wrote Hamlet?"
        )
    ]
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


@pytest.mark.parametrize(
    "policy",
    [
        # floor, cad and adacad read the same fused rows as tokrag: slow (make test-all).
        pytest.param("floor", marks=pytest.mark.slow),
        pytest.param("cad", marks=pytest.mark.slow),
        pytest.param("adacad", marks=pytest.mark.slow),
        "tokrag",
    ],
)
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
    from tokrag_integrations.attention.parts import model_parts
    from tokrag_integrations.attention.rows import attention_row, attention_rows, cached_keys

    tok = lm.tokenizer
    prompts = [
        tok.encode("Who wrote Hamlet?"),
        tok.encode("The play Hamlet was written by Shakespeare."),
    ]
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


def test_lazy_chunked_signals_equal_a_full_computation(lm, monkeypatch):
    """The lens is read a few layers at a time, with shared and extra rows; a plain
    computation over every layer must give the same fusion layers, l* and rising token."""
    from tokrag_integrations.attention.rows import logit_lens
    from tokrag_integrations.policies import signals as S
    from tokrag_integrations.policies.tokrag import TokRAG

    seen = []
    orig = TokRAG.signals

    def checked(self, pure, rag):
        out = yield from orig(self, pure, rag)  # the signals ask the engine's lens for rows
        parts, L = self._parts, self._L
        attn = torch.stack([rag.attention(i) for i in range(L)])
        f = S.retrieved_attention_mass(attn, rag.rt_positions)
        lens = {
            name: torch.log_softmax(
                logit_lens(parts, v.record.resid[:, 0], final_norm=self.lens_norm), dim=-1
            )
            for name, v in (("pure", pure), ("rag", rag))
        }
        p = {name: lp.exp() for name, lp in lens.items()}
        g = (S.jsd(p["rag"][:-1], p["rag"][1:]) - S.jsd(p["pure"][:-1], p["pure"][1:])).abs()
        l_star, fa, gf = S.fusion_layer(
            f,
            g,
            vocab_size=self._A.shape[0],
            threshold=self.jsd_threshold,
            min_fusion_layer=self._lo,
        )
        final = lens["rag"][L] if not self.lens_norm else torch.log_softmax(rag.logits.float(), -1)
        rise = S.rising_token(final, lens["rag"][l_star], alpha=self.plausibility_alpha)
        seen.append(
            (out["l_star"], out["fusion_attn_layer"], out["fusion_jsd_layer"], out["rising_token"])
        )
        assert (out["l_star"], out["fusion_attn_layer"], out["fusion_jsd_layer"]) == (
            l_star,
            fa,
            gf,
        )
        assert out["rising_token"] == self._tok.decode([rise])
        return out

    monkeypatch.setattr(TokRAG, "signals", checked)
    for q, ps in (CONTRA, FICTION):
        literal = {
            "lens_norm": False,
            "top_k": None,
            "min_fusion_layer": 0,
            "plausibility_alpha": None,
        }
        for opts in ({}, literal):
            generate(lm, q, ps, policy="tokrag", max_new_tokens=24, policy_options=opts)
    assert len(seen) >= 4
    assert len({s[2] for s in seen}) > 1  # crossings in more than one lens chunk


@torch.inference_mode()
def test_shared_prompt_head_is_reused_from_the_longer_prefill(lm):
    """The pure prompt (head + question) reuses the RAG prefill's head: same logits, cache
    and probe records as prefilling it in full."""
    from tokrag_integrations.contexts.batch import MIN_SHARED_PREFIX
    from tokrag_integrations.policies.tokrag import TokRAG
    from tokrag_integrations.prompts import PromptBuilder

    plan = PromptBuilder(lm.tokenizer, context_window=lm.context_window).build(*FICTION)
    specs = TokRAG().contexts(plan)
    assert len(plan.head_ids) >= MIN_SHARED_PREFIX
    batches = prefill_roles(("pure", "rag"), [specs], lm, frozenset({"pure", "rag"}))
    assert list(batches) == ["pure", "rag"]
    reused, rag = batches["pure"], batches["rag"]
    assert reused.shared_prefix(rag) == len(plan.head_ids)
    full = _RoleBatch("pure", [(0, specs["pure"])], lm, probe=True)
    full.forward(None)
    assert reused.cache.get_seq_length() == full.cache.get_seq_length() == len(plan.pure_ids)
    assert torch.allclose(reused.logits, full.logits, atol=1e-4)
    for i in (0, 7, len(reused.cache.layers) - 1):
        assert torch.allclose(reused.cache.layers[i].keys, full.cache.layers[i].keys, atol=1e-4)
    assert torch.allclose(reused.records.resid, full.records.resid, atol=1e-4)
    for tid in (464, 318):
        reused.forward(torch.tensor([tid]))
        full.forward(torch.tensor([tid]))
        assert torch.allclose(reused.logits, full.logits, atol=1e-3)
    # Nothing to reuse: a different head, or rows of unequal length.
    other = _RoleBatch(
        "rag", [(0, ContextSpec(lm.tokenizer.encode("Hello there, " * 6)))], lm, probe=False
    )
    other.forward(None)
    assert _RoleBatch("pure", [(0, specs["pure"])], lm, probe=False).shared_prefix(other) == 0
    uneven = _RoleBatch(
        "pure", [(0, specs["pure"]), (1, ContextSpec(specs["pure"].ids[:-3]))], lm, probe=False
    )
    assert uneven.shared_prefix(rag) == 0


def test_packed_head_changes_no_decision_on_the_real_model(lm, monkeypatch):
    """The logit lens through the packed head equals the routed one to float rounding, and
    tokrag gives the same tokens and decisions with it on and off (the trace's signals
    come from the lens)."""
    from tokrag_integrations.attention.parts import model_parts
    from tokrag_integrations.attention.rows import logit_lens

    head = lm.model.get_output_embeddings()
    parts = model_parts(lm.model)
    rows = torch.randn(14, lm.model.config.hidden_size)
    out = {}
    traces = {}
    saved = getattr(head, K._HEAD, None)
    try:
        for mode in ("off", "on"):
            if hasattr(head, K._HEAD):
                delattr(head, K._HEAD)
            product = PH.packed_head(head, mode)
            assert (product is not None) == (mode == "on" and torch.backends.mkldnn.is_available())
            with torch.inference_mode():
                out[mode] = logit_lens(parts, rows, product=product)
            r = generate(
                lm, *CONTRA, policy="tokrag", max_new_tokens=24, speed={"packed_head": mode}
            )
            traces[mode] = [
                (s.token_id, s.source, s.signals.get("benefit"), s.signals.get("l_star"))
                for s in r.trace.steps
            ]
    finally:
        if hasattr(head, K._HEAD):
            delattr(head, K._HEAD)
        if saved is not None:
            setattr(head, K._HEAD, saved)
    assert torch.allclose(out["on"], out["off"], atol=1e-3, rtol=1e-4)
    assert traces["on"] == traces["off"]
    assert any(t[2] is not None for t in traces["on"])  # some steps ran the signals
