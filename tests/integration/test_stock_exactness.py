"""Every default fast path against the fully stock one, on the packaged model.

The reference is a second copy of the model loaded with ``cpu_kernels="off"`` (no few-row
linear plans, no few-query attention path, so no packed prefill and no packed LM head) and
decoded with ``speed="reference"`` (one forward pass per context per step, no fusing, no
shared logit lens): transformers' own forward passes, as written. The fast paths are the
defaults of the session's model: one query at a time (packed prefill, fused contexts, the CPU
kernels, the packed head where measured faster) and a batch of all the prompts (shared logit
lens rows). Tokens, sources and each step's candidates must be equal.

The prompts vary in length (short and long questions, 0 to 5 passages, a passage that
contradicts the model) so that the rule meets disagreements and decides them; a few tokens
each keep the module cheap."""

from __future__ import annotations

import pytest
from _capture import recorded_on_cpu
from _helpers import slow_except

from tokrag_integrations import generate, generate_batch, load_model
from tokrag_integrations.accel.install import speed_paths
from tokrag_integrations.accel.static_graphs import kept_graphs
from tokrag_integrations.retrieval import (
    BM25Retriever,
    chunk_documents,
    get_sample_docs_path,
    get_sample_questions,
    load_documents,
)

#: (prompts, new tokens) of the default comparison and of the extended one (marked slow).
SIZES = [pytest.param(20, 4, id="20x4"), pytest.param(24, 16, id="24x16", marks=pytest.mark.slow)]
#: Short chunks keep the prompts (and the reference's unfused passes) cheap.
CHUNK_CHARS = 160
LONG_QUESTION = (
    "I am writing a short report for a school project about small aerospace companies in "
    "northern Europe, and I would like to know, in one sentence if possible, who founded "
    "Quillfeather Aerospace and in which town the company was started?"
)


def exactness_prompts() -> list[tuple[str, list[str]]]:
    """24 (question, passages) pairs: four hand-made cases (an unknown fact, a contradiction,
    a long question, five passages), then each sample question with two passage counts.
    (``benchmarks/gpu_check.py`` runs the same prompts on a GPU.)"""
    chunks = chunk_documents(load_documents(get_sample_docs_path()), max_chars=CHUNK_CHARS, overlap=0)
    bm25 = BM25Retriever(chunks)

    def top(q: str, k: int) -> list[str]:
        return [h.chunk.text for h in bm25.retrieve(q, top_k=k)] if k else []

    questions = [q["question"] for q in get_sample_questions()]
    out = [
        ("What is the name of the cat owned by Zorbin Quell?",
         ["Zorbin Quell owns a grey cat named Pistachio."]),
        ("What is the capital of France?", ["The capital of France is Marseille."]),
        (LONG_QUESTION, top("Quillfeather founded", 2)),
        (questions[0], top(questions[0], 5)),
    ]
    out += [(q, top(q, k)) for i, q in enumerate(questions) for k in (i % 4, (i + 2) % 4)]
    assert len(out) == 24
    return out


@pytest.fixture(scope="module")
def prompts() -> list[tuple[str, list[str]]]:
    return exactness_prompts()


@pytest.fixture(scope="module")
def stock():
    """The packaged model with every CPU speed path off (a second copy: the session's model
    has them installed in place)."""
    return load_model("default", device="cpu", cpu_kernels="off")


def _decisions(r) -> list[tuple]:
    """Per step: the chosen token, its source and each context's top-1 candidate."""
    return [
        (s.token_id, s.source, sorted((role, c.token_id) for role, c in s.candidates.items()))
        for s in r.trace.steps
    ]


@pytest.fixture(scope="module")
def reference(stock, prompts):
    """``reference(count, n)``: the stock decodes of the first ``count`` prompts, ``n`` new
    tokens each (made once per module)."""
    made: dict = {}

    def run(count: int, n: int) -> list:
        if (count, n) not in made:
            made[count, n] = [
                generate(stock, q, ps, policy="tokrag", speed="reference", max_new_tokens=n)
                for q, ps in prompts[:count]
            ]
        return made[count, n]

    return run


def test_the_reference_runs_no_speed_path(stock, lm):
    paths = speed_paths(stock.model)
    for name in ("cpu_kernels", "packed_prefill", "packed_head"):
        assert paths[name].startswith("off"), (name, paths[name])
    assert speed_paths(lm.model)["packed_prefill"] == "on"  # the fast side does run them


def test_the_prompts_make_the_rule_decide(reference):
    """The default comparison's premise: its prompts make the rule decide both ways."""
    made = reference(*SIZES[0].values)
    steps = [s for r in made for s in r.trace.steps]
    assert sum(s.disagreement for s in steps) >= 10
    assert {s.source for s in steps if s.disagreement} >= {"rag", "pure"}
    assert sum(not r.trace.passages for r in made) >= 3  # some answer without passages


@pytest.mark.parametrize(("count", "n"), SIZES)
def test_one_query_at_a_time_equals_the_stock_path(lm, prompts, reference, count, n):
    for (q, ps), want in zip(prompts[:count], reference(count, n), strict=True):
        got = generate(lm, q, ps, policy="tokrag", max_new_tokens=n)
        assert got.token_ids == want.token_ids, q
        assert _decisions(got) == _decisions(want), q


@pytest.mark.parametrize(("count", "n"), SIZES)
def test_a_batch_equals_the_stock_path(lm, prompts, reference, count, n):
    got = generate_batch(lm, [q for q, _ in prompts[:count]], [ps for _, ps in prompts[:count]],
                         policy="tokrag", max_new_tokens=n)
    for (q, _), g, want in zip(prompts[:count], got, reference(count, n), strict=True):
        assert g.token_ids == want.token_ids, q
        assert _decisions(g) == _decisions(want), q


#: The policies of the ``speed="cuda"`` comparison: with a device rule, each is decoded on
#: the static state; without one, on the view path, and the trace says so.
CUDA_POLICIES = ("tokrag", "rag", "no_rag", "floor", "cad", "rag_token", "tokrag_authors")
#: Prompts and new tokens of that comparison (per policy: a reference decode each).
CUDA_COUNT, CUDA_TOKENS = 8, 6


@pytest.fixture(scope="module")
def policy_reference(stock, prompts):
    """``policy_reference(policy)``: the stock decodes of the first :data:`CUDA_COUNT`
    prompts under ``policy``, citations on for every policy that can cite."""
    made: dict = {}

    def run(policy: str) -> list:
        if policy not in made:
            made[policy] = [
                generate(stock, q, ps, policy=policy, speed="reference",
                         max_new_tokens=CUDA_TOKENS, citations=True)
                for q, ps in prompts[:CUDA_COUNT]
            ]  # fmt: skip
        return made[policy]

    return run


def _static_used(r) -> bool:
    """Whether ``r`` was decoded on the static state; else the trace must say why not."""
    if r.trace.timings.get("static") == 1.0:
        return True
    assert r.trace.speed["speed_paths_off"]["static"], r.trace.speed
    return False


def _citations(r) -> list:
    return [s.citation for s in r.trace.steps]


@pytest.mark.parametrize("policy", slow_except(CUDA_POLICIES, "tokrag", "rag", "cad"))
def test_the_cuda_path_equals_the_stock_path(lm, prompts, policy_reference, policy):
    """``speed="cuda"`` (the static state and the device rule where the policy has one):
    tokens, sources, each step's top-1 candidates and the citations of the reference, one
    query at a time and as a batch."""
    want = policy_reference(policy)
    qs, pss = [q for q, _ in prompts[:CUDA_COUNT]], [ps for _, ps in prompts[:CUDA_COUNT]]
    alone = [
        generate(lm, q, ps, policy=policy, speed="cuda", max_new_tokens=CUDA_TOKENS, citations=True)
        for q, ps in zip(qs, pss, strict=True)
    ]
    batch = generate_batch(lm, qs, pss, policy=policy, speed="cuda", max_new_tokens=CUDA_TOKENS,
                           citations=True)  # fmt: skip
    for got in (alone, batch):
        for q, g, w in zip(qs, got, want, strict=True):
            _static_used(g)  # (a query without passages is decoded by "no_rag"'s rule)
            assert g.token_ids == w.token_ids, (policy, q)
            assert _decisions(g) == _decisions(w), (policy, q)
            for a, b in zip(_citations(g), _citations(w), strict=True):
                assert a == pytest.approx(b, abs=1e-3), (policy, q)


@pytest.mark.parametrize("policy", slow_except(("tokrag", "rag", "cad"), "tokrag"))
def test_the_recorded_step_equals_the_stock_path(lm, prompts, policy_reference, policy, monkeypatch):
    """``graphs="capture"``, its step recorded once per shape and replayed (on a CPU, traced
    with a CUDA graph's semantics: ``tests/_capture.py``): the reference's tokens, decisions
    and citations, one query at a time (later queries replay the graphs of earlier ones) and
    as a batch."""
    want = policy_reference(policy)[:3]  # three prompts: the recording is traced on a CPU
    qs, pss = [q for q, _ in prompts[:3]], [ps for _, ps in prompts[:3]]
    speed = {"static": "on", "fuse": True, "graphs": "capture"}
    kw = dict(policy=policy, speed=speed, max_new_tokens=CUDA_TOKENS, citations=True)
    with recorded_on_cpu(monkeypatch, lm) as recorder:
        alone = [generate(lm, q, ps, **kw) for q, ps in zip(qs, pss, strict=True)]
        batch = generate_batch(lm, qs, pss, **kw)
        counts = dict(kept_graphs(lm).counts)
    assert sum(g.recorded for g in recorder.made) >= 2 and counts["replayed"] > counts["eager"]
    for got in (alone, batch):
        for q, g, w in zip(qs, got, want, strict=True):
            if _static_used(g):
                assert g.trace.timings.get("cuda_graphs") == 1.0
            assert g.token_ids == w.token_ids, (policy, q)
            assert _decisions(g) == _decisions(w), (policy, q)
            for a, b in zip(_citations(g), _citations(w), strict=True):
                assert a == pytest.approx(b, abs=1e-3), (policy, q)
