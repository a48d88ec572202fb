"""The sampler of issue 57 (``tokrag_integrations.sampling``) on hand-made logits: greedy
rows are the argmax, sampled rows follow softmax(z / T) cut to top-k / top-p, a row's token
depends on its own inputs only, the noise is the documented hash, and bad keyword values get
a one-sentence ValueError naming the keyword."""

from __future__ import annotations

import math

import pytest
import torch

from tokrag_integrations.sampling import (
    Sampling,
    allowed_from_bitmask,
    bitmask_words,
    cut_logits,
    draw,
    logprobs,
    sampling_of,
    uniform_noise,
)


def _rows(n, **kw):
    t = torch.full((n,), float(kw.get("temperature", 1.0)))
    p = torch.full((n,), float(kw.get("top_p", 1.0)))
    k = torch.full((n,), int(kw.get("top_k", 0)), dtype=torch.long)
    seed = torch.full((n,), int(kw.get("seed", 7)), dtype=torch.long)
    return t, p, k, seed


def _frequencies(z: torch.Tensor, n: int = 20000, **kw) -> torch.Tensor:
    """Token frequencies of ``n`` draws from logits ``z`` [V] (one seed, steps 0..n-1)."""
    t, p, k, seed = _rows(n, **kw)
    ids = draw(z.expand(n, -1), t, p, k, seed, torch.arange(n))
    return torch.bincount(ids, minlength=z.shape[0]).double() / n


def test_greedy_rows_are_the_argmax_bit_exact():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 300, generator=g)
    z[3, 10] = z[3, 20] = z[3].max() + 1  # a tie: the first index, as torch.argmax
    t, p, k, seed = _rows(16, temperature=0.0, top_p=0.3, top_k=5)
    assert torch.equal(draw(z, t, p, k, seed, torch.arange(16)), torch.argmax(z, dim=-1))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_many_draws_follow_the_softmax(temperature):
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    want = torch.softmax(z / temperature, dim=-1).double()
    got = _frequencies(z, temperature=temperature)
    # 20000 draws: the standard error of a frequency is at most 0.0036.
    assert torch.allclose(got, want, atol=0.015), (got, want)


def test_top_k_keeps_the_k_most_likely_tokens_renormalised():
    z = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0])
    got = _frequencies(z, top_k=2)
    assert got[2:].sum() == 0
    want = torch.softmax(z[:2], dim=-1).double()
    assert torch.allclose(got[:2], want, atol=0.015)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    z = probs.log()
    assert set(torch.nonzero(_frequencies(z, 4000, top_p=0.7)).flatten().tolist()) == {0, 1}
    assert set(torch.nonzero(_frequencies(z, 4000, top_p=0.85)).flatten().tolist()) == {0, 1, 2}
    assert set(torch.nonzero(_frequencies(z, 4000, top_p=0.1)).flatten().tolist()) == {0}
    got = _frequencies(z, top_p=0.85)
    assert torch.allclose(got[:3], (probs[:3] / probs[:3].sum()).double(), atol=0.015)


def test_cut_logits_of_top_k_and_top_p_together():
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    out = cut_logits(z, torch.tensor([1.0]), torch.tensor([0.99]), torch.tensor([3]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False, False]]


def test_without_a_cut_the_draw_skips_the_sort_and_draws_the_same_tokens():
    """``draw(..., cut=False)`` (the view path where no query asks for top-k or top-p) gives
    the tokens of the full cut: z / T is what the cut keeps when it keeps every token."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=g) * 3
    logits[1, 7] = float("-inf")  # a masked token
    t = torch.tensor([0.0, 0.7, 1.0, 1.5, 0.3])
    p, k = torch.ones(5), torch.zeros(5, dtype=torch.long)
    for step in range(20):
        args = (t, p, k, torch.arange(5) + 11, torch.full((5,), step))
        assert torch.equal(draw(logits, *args), draw(logits, *args, cut=False))


def test_top_k_1_is_greedy_and_masked_tokens_are_never_drawn():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(8, 500, generator=g)
    t, p, k, seed = _rows(8, temperature=1.5, top_k=1)
    assert torch.equal(draw(z, t, p, k, seed, torch.arange(8)), torch.argmax(z, dim=-1))
    masked = z.clone()
    masked[:, 100:] = float("-inf")
    t, p, k, seed = _rows(8, temperature=5.0)
    for step in range(20):
        assert (draw(masked, t, p, k, seed, torch.full((8,), step)) < 100).all()


def test_a_row_gets_the_same_token_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(6, 400, generator=g)
    t = torch.tensor([0.7, 0.0, 1.0, 1.3, 0.9, 1.0])
    p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.8])
    k = torch.tensor([0, 0, 50, 0, 10, 0])
    seed = torch.tensor([1, 2, 3, 4, 5, -6])
    step = torch.tensor([0, 3, 9, 1, 4, 2])
    batch = draw(z, t, p, k, seed, step)
    for i in range(6):
        alone = draw(z[i : i + 1], t[i : i + 1], p[i : i + 1], k[i : i + 1], seed[i : i + 1], step[i : i + 1])
        assert alone.item() == batch[i].item()
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    again = draw(z[order], t[order], p[order], k[order], seed[order], step[order])
    assert again.tolist() == batch[order].tolist()


def test_seeds_and_steps_change_the_draws():
    z = torch.zeros(1, 1000)  # uniform: any token
    t, p, k, _ = _rows(1)
    a = [draw(z, t, p, k, torch.tensor([1]), torch.tensor([s])).item() for s in range(10)]
    b = [draw(z, t, p, k, torch.tensor([2]), torch.tensor([s])).item() for s in range(10)]
    again = [draw(z, t, p, k, torch.tensor([1]), torch.tensor([s])).item() for s in range(10)]
    assert a == again and a != b and len(set(a)) > 5


def _hash32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_noise_is_the_documented_hash_without_overflow():
    seeds = [0, 1, 2**40 + 5, -3, 2**62]
    steps = [0, 7, 123456, 1, 2**31]
    u = uniform_noise(torch.tensor(seeds), torch.tensor(steps), 70)
    for row, (s, st) in enumerate(zip(seeds, steps, strict=True)):
        key = _hash32(s & 0xFFFFFFFF)
        key = _hash32(key ^ ((s >> 32) & 0xFFFFFFFF))
        key = _hash32(key ^ (st & 0xFFFFFFFF))
        for v in (0, 1, 33, 69):
            h = _hash32(_hash32(key ^ v) ^ 0x9E3779B9)
            assert u[row, v].item() == ((h >> 9) + 0.5) / (1 << 23)
    assert 0 < u.min().item() and u.max().item() < 1


def test_logprobs_are_the_log_softmax_at_the_token_and_the_top_k():
    z = torch.tensor([[1.0, 3.0, 2.0, float("-inf")]])
    lp, ids, top = logprobs(z, torch.tensor([2]), 2)
    want = torch.log_softmax(z, dim=-1)
    assert lp.item() == pytest.approx(want[0, 2].item())
    assert ids.tolist() == [[1, 2]]
    assert top[0].tolist() == pytest.approx(want[0, [1, 2]].tolist())
    _, ids0, top0 = logprobs(z, torch.tensor([2]), 0)
    assert ids0.shape == (1, 0) and top0.shape == (1, 0)


def test_the_bitmask_layout_is_llguidances():
    V = 70
    bm = torch.zeros((2, bitmask_words(V)), dtype=torch.int32)
    allow = [[0, 31, 32, 69], [5]]
    for r, toks in enumerate(allow):
        for t in toks:
            word = int(bm[r, t // 32]) | (1 << (t % 32))
            bm[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    got = allowed_from_bitmask(bm, V)
    assert got.shape == (2, V)
    assert [torch.nonzero(r).flatten().tolist() for r in got] == allow


def test_sampling_of_defaults_and_a_drawn_seed():
    assert sampling_of() == Sampling()
    assert sampling_of().greedy and sampling_of(temperature=0, seed=3).record() == {}
    s = sampling_of(temperature=0.7)
    assert not s.greedy and isinstance(s.seed, int)
    assert s.record() == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": s.seed}
    assert sampling_of(temperature=1, seed=5, top_k=3, top_p=0.5, top_logprobs=20).seed == 5


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"seed": "x"}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_a_bad_value_names_its_keyword(kw, name):
    with pytest.raises(ValueError) as e:
        sampling_of(**kw)
    msg = str(e.value)
    assert msg.startswith(name + " must be") and msg.count(". ") == 0 and "\n" not in msg


def test_a_traces_logprobs_and_sampling_go_through_json():
    from tokrag_integrations.results import GenerationResult
    from tokrag_integrations.trace import TopLogprob, Trace, TraceStep

    step = TraceStep(0, 5, "é", "rag", logprob=-0.5, top_logprobs=[TopLogprob(5, "é", -0.5), TopLogprob(7, "a", -1.5)])
    t = Trace(query="q", policy="rag", steps=[step], sampling={"temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": 3})
    back = Trace.from_dict(t.to_dict())
    assert back == t
    r = GenerationResult("é", back, [5])
    assert r.logprobs == [
        {
            "token": "é",
            "logprob": -0.5,
            "bytes": [195, 169],
            "top_logprobs": [
                {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
                {"token": "a", "logprob": -1.5, "bytes": [97]},
            ],
        }
    ]
    bad = t.to_dict()
    bad["steps"][0]["top_logprobs"] = [{"token_id": 1, "text": "a"}]
    with pytest.raises(ValueError, match=r"trace.steps\[0\].top_logprobs\[0\] has no 'logprob'"):
        Trace.from_dict(bad)
