"""Architecture matrix (issue 22): tiny random-weight models built locally from configs.

Each model (hidden size 64, 2 layers, 4 query / 2 key-value heads, the default model's
tokenizer and vocabulary, tied embeddings: ~13 MB in float32) is built in memory, never
downloaded. For Llama, Mistral (sliding window), Qwen2, Qwen3 (per-head q/k norms), Gemma 2
(soft-capping, sliding window), Gemma 3 text (sliding and full layers), Phi-3 (fused
[Q | K | V] projection), OLMo 2 (post-norm layers, q/k norms over all heads) and Granite
(embedding / residual / attention multipliers, logits scaling), in float32 and bfloat16:

* ``rag`` and ``no_rag`` equal ``model.generate(do_sample=False)`` token for token;
* ``tokrag`` runs with finite signals and a consistent trace;
* every fast path (packed prefill, fused contexts, CPU kernels on
  and off) gives the step-by-step decoder's tokens and sources (on Llama, Gemma 3 and Phi-3
  by default, on every architecture with ``-m slow``);
* (float32) the attention rows the signals read equal eager attention past the sliding
  window, both from the queries the CPU path keeps and recomputed from the attention input,
  and the logit lens of the last layer equals the model's logits.

GPT-NeoX (a fused, per-head interleaved ``query_key_value``) and Phi (partial rotary, no
``model.layers``-style final norm) are refused by ``load_model`` with one sentence naming
``require_signals=False``, under which ``rag`` still equals ``generate``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _helpers import greedy_generate, tiny_model

from tokrag_integrations import generate, load_model
from tokrag_integrations.prompts import PromptBuilder

Q = "What is the name of the cat owned by Zorbin Quell?"
P = ["Zorbin Quell owns a grey cat named Pistachio.", "Pistachio sleeps on the red sofa."]
#: Longer than the sliding window (16) of the Mistral / Gemma configs below.
FILLER = [f"Note {i}: Marrowby is a small village on the northern coast." for i in range(3)]
WINDOW = 16
NEW_TOKENS = 8

#: name -> (config class, model class, config overrides). ``initializer_range`` is raised so
#: that random models disagree between contexts (Gemma's scaled embeddings need the default).
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "sliding_window": WINDOW, "initializer_range": 0.02},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "initializer_range": 0.02,
        },
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 4.0,
        },
    ),
}
REFUSED = {"gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"), "phi": ("PhiConfig", "PhiForCausalLM")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CASES = [pytest.param(a, d, id=f"{a}-{d}") for a in ARCHS for d in DTYPES]
#: The speed-path matrix runs on three architectures by default (a plain one, the one with
#: sliding and full layers and soft-capping, the one with a fused [Q | K | V] projection);
#: the others are marked slow (``make test-all`` runs them).
SPEED_DEFAULT = ("llama", "gemma3", "phi3")
SPEED_CASES = [
    pytest.param(a, d, id=f"{a}-{d}", marks=() if a in SPEED_DEFAULT else pytest.mark.slow)
    for a in ARCHS
    for d in DTYPES
]


def _build(arch: str, tok, vocab_size: int, dtype: torch.dtype):
    cfg_name, cls_name, extra = ARCHS[arch]
    return tiny_model(tok, config=cfg_name, model=cls_name, vocab_size=vocab_size, **extra).to(dtype)


@pytest.fixture(scope="module")
def models(lm):
    """``models(arch, dtype, cpu_kernels="auto")`` -> (LoadedModel, stock reference copy),
    built once per module."""
    cache: dict = {}

    def get(arch: str, dtype: str, cpu_kernels: str = "auto"):
        key = (arch, dtype, cpu_kernels)
        if key not in cache:
            model = _build(arch, lm.tokenizer, lm.vocab_size, DTYPES[dtype])
            reference = copy.deepcopy(model)  # before load_model installs the CPU paths
            tiny = load_model(model, tokenizer=lm.tokenizer, cpu_kernels=cpu_kernels)
            cache[key] = (tiny, reference)
        return cache[key]

    return get


def _plan(tiny, passages=P):
    return PromptBuilder(tiny.tokenizer, context_window=tiny.context_window).build(Q, passages)


def _hf_generate(tiny, reference, ids: list[int]) -> list[int]:
    kept = []
    for i in greedy_generate(reference, ids, NEW_TOKENS, tiny.pad_token_id):
        if i in tiny.eos_token_ids:
            break
        kept.append(i)
    return kept


@pytest.mark.parametrize("arch,dtype", CASES)
def test_baselines_equal_model_generate(models, arch, dtype):
    tiny, reference = models(arch, dtype)
    plan = _plan(tiny)
    for policy, ids in (("no_rag", plan.pure_ids), ("rag", plan.rag_ids)):
        want = _hf_generate(tiny, reference, ids)
        assert want, "the reference answer is empty: the matrix would test nothing"
        assert generate(tiny, Q, P, policy=policy, max_new_tokens=NEW_TOKENS).token_ids == want, policy


def _decode(tiny, **options):
    return generate(tiny, Q, P, policy="tokrag", max_new_tokens=NEW_TOKENS, **options)


@pytest.mark.parametrize("arch,dtype", CASES)
def test_tokrag_runs_with_finite_signals_and_a_consistent_trace(models, arch, dtype):
    tiny, _ = models(arch, dtype)
    r = _decode(tiny, speed={"fuse": False})
    steps = r.trace.steps
    assert steps and [s.token_id for s in steps] == r.token_ids
    assert r.text == tiny.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    assert sum(r.counts.values()) == len(steps)
    assert {s.source for s in steps} <= {"agree", "rag", "pure"}
    disagreements = [s for s in steps if s.source != "agree"]
    for s in disagreements:
        if str((s.signals or {}).get("note", "")).startswith("gated:"):  # kept without comparing
            continue
        values = [v for v in (s.signals or {}).values() if isinstance(v, float)]
        assert values and all(math.isfinite(v) for v in values), s.signals
    if arch not in ("gemma2", "gemma3"):  # random Gemmas mostly agree; their rows are read below
        assert disagreements, "no disagreement step: the signals were never read"


@pytest.mark.parametrize("arch,dtype", SPEED_CASES)  # five decodes per case
def test_fast_paths_give_the_step_by_step_tokens(models, arch, dtype, monkeypatch):
    tiny, _ = models(arch, dtype)
    step = _decode(tiny, speed={"fuse": False})
    want = (step.token_ids, [s.source for s in step.trace.steps])

    def got(r):
        return r.token_ids, [s.source for s in r.trace.steps]

    assert got(_decode(tiny)) == want, "packed prefill + fused steps (the default)"
    assert got(_decode(tiny, speed={"packed_prefill": False})) == want, "fused contexts, separate prefills"
    if dtype == "float32":  # the CPU kernels are installed on float32 CPU models only
        for mode in ("off", "on"):
            other, _ = models(arch, dtype, mode)
            assert got(_decode(other)) == want, f"cpu_kernels={mode}"


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_signals_read_the_model_past_the_window(models, arch, cpu_kernels):
    """After a prefill and one decode step through the engine's own batch, every layer's
    attention row (from the kept queries with the CPU kernels, recomputed from the attention
    input without) equals eager attention, and the lens of the last layer the logits."""
    from tokrag_integrations.attention.parts import model_parts
    from tokrag_integrations.attention.rows import logit_lens
    from tokrag_integrations.contexts.batch import RoleBatch as _RoleBatch
    from tokrag_integrations.engine.view import ContextView
    from tokrag_integrations.policies.base import ContextSpec

    tiny, reference = models(arch, "float32", cpu_kernels)
    eager = copy.deepcopy(reference)
    eager.set_attn_implementation("eager")
    plan = _plan(tiny, P + FILLER)
    assert len(plan.rag_ids) > 4 * WINDOW
    parts = model_parts(tiny.model)
    nxt = 1234
    with torch.inference_mode():
        spec = ContextSpec(plan.rag_ids, plan.retrieved_positions)
        b = _RoleBatch("rag", [(0, spec)], tiny, probe=True)
        b.forward(None)
        b.forward(torch.tensor([nxt]))
        view = ContextView(b, 0, b.records)
        assert (b.records.query is not None) == (cpu_kernels == "auto" and arch in _KEPT)
        mine = view.attention_all()
        out = eager(input_ids=torch.tensor([plan.rag_ids + [nxt]]), output_attentions=True)
        for layer in range(parts.num_layers):
            ref = out.attentions[layer][0, :, -1, :]
            torch.testing.assert_close(mine[layer], ref, atol=1e-4, rtol=0, msg=f"layer {layer}")
        torch.testing.assert_close(b.logits[0], out.logits[0, -1], atol=1e-3, rtol=0)
        lens = logit_lens(parts, b.records.resid[parts.num_layers, :1])[0]
        torch.testing.assert_close(lens, b.logits[0].float(), atol=1e-3, rtol=0)


#: Architectures whose probed steps keep their rotated queries on the CPU path (no sliding
#: window, no soft-capping: the kept query reproduces the attention as computed).
_KEPT = {"llama", "qwen2", "qwen3", "phi3", "olmo2", "granite"}


@pytest.mark.parametrize("arch", list(REFUSED))
def test_fused_interleaved_qkv_is_refused_with_the_fix(lm, arch):
    cfg_name, cls_name = REFUSED[arch]
    model = tiny_model(lm.tokenizer, config=cfg_name, model=cls_name, vocab_size=lm.vocab_size)
    reference = copy.deepcopy(model)
    why = "fused query/key/value" if arch == "gpt_neox" else "final norm"
    with pytest.raises(ValueError, match=f"signals cannot read this architecture.*{why}.*require_signals=False"):
        load_model(model, tokenizer=lm.tokenizer)
    tiny = load_model(model, tokenizer=lm.tokenizer, require_signals=False)
    plan = _plan(tiny)
    want = _hf_generate(tiny, reference, plan.rag_ids)
    assert generate(tiny, Q, P, policy="rag", max_new_tokens=NEW_TOKENS).token_ids == want


def test_speed_paths_switch_off_where_not_measured(models, lm):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tokrag_integrations.accel.install import speed_off_reason, speed_paths

    fp32, _ = models("qwen2", "float32")
    # The paths are installed before a model's first decode (engine.seam.prepare), not at load.
    trace = _decode(fp32).trace
    paths = speed_paths(fp32.model)
    assert paths["packed_prefill"] == paths["fused_contexts"] == "on"
    # The few-row kernels and the packed head are measured on each machine: on a tiny model the
    # stock product may win every shape, and then they stay off, but only for that reason,
    # never for the dtype, the architecture or the device.
    off = trace.speed["speed_paths_off"]
    assert "speed_paths_off" not in trace.options  # not the rule's: what this machine measured
    assert set(off) <= {"cpu_kernels", "packed_head"}, off
    assert all(
        reason.startswith(("no few-row plan installed", "measured slower")) for reason in off.values()
    ), off
    bf16, _ = models("qwen2", "bfloat16")
    off = _decode(bf16).trace.speed["speed_paths_off"]
    paths = speed_paths(bf16.model)
    for path in ("cpu_kernels", "packed_prefill", "packed_head"):
        assert paths[path].startswith("off: dtype bfloat16"), paths
    assert paths["fused_contexts"] == "on"  # measured by the matrix in bfloat16 too
    assert set(off) == {"cpu_kernels", "packed_prefill", "packed_head"}
    # An architecture outside the matrix: everything off, fused contexts included.
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=lm.vocab_size))
    other = load_model(gpt2, tokenizer=lm.tokenizer, require_signals=False)
    assert generate(other, Q, P, policy="floor", max_new_tokens=2).trace.timings["fused"] == 0.0
    paths = speed_paths(other.model)
    assert all("'gpt2' is not in the tested matrix" in v for v in paths.values()), paths
    # Not measured on other devices (the meta device stands in for a GPU here).
    meta = _build("llama", lm.tokenizer, 64, torch.float32).to("meta")
    assert speed_off_reason(meta).startswith("device meta: ")
