"""Extra decoding policies (spec §5): selection baselines, CAD / AdaCAD, RAG-Token, RAG-Sequence.

The rules are checked on hand-made distributions through stand-in context views; the real
model checks the identities the rules must satisfy (RAG-Token with one passage == RAG,
CAD with α = 0 == RAG) and RAG-Sequence's trace.

This file holds the cases that need a model, a database or a server are in
``tests/integration/test_policies_extra.py``."""

from __future__ import annotations

import math

import pytest
import torch

from tokrag_integrations.policies import available_policies, get_policy
from tokrag_integrations.policies import signals as S
from tokrag_integrations.policies.base import ContextSpec
from tokrag_integrations.policies.rag_token import passage_weights
from tokrag_integrations.policies.selection import entropy_margin, logprob_margin
from tokrag_integrations.prompts import Passage


class FakeView:
    """The part of a ContextView the rules read: logits, probs, spec."""

    def __init__(self, probs: list[float], weight: float | None = None):
        p = torch.tensor(probs, dtype=torch.float32)
        self.probs = p
        self.logits = torch.log(p.clamp_min(1e-12))
        self.spec = ContextSpec([], [], weight=weight)


def _one(pol, views):
    """The rule's choice for one query (a batch of one)."""
    return pol.choose([views], None)[0]


def test_registry_has_the_new_policies():
    for name in ("logprob", "entropy", "cad", "adacad", "rag_token", "rag_sequence"):
        assert name in available_policies()
        assert get_policy(name).name == name


def test_logprob_selection_prefers_the_more_confident_top1():
    pure = FakeView([0.6, 0.3, 0.1])
    rag = FakeView([0.1, 0.5, 0.4])
    pol = get_policy("logprob")
    c = _one(pol, {"pure": pure, "rag": rag})
    assert (c.token_id, c.source) == (0, "pure")
    assert c.signals["margin"] == pytest.approx(math.log(0.5) - math.log(0.6), abs=1e-6)
    c = _one(pol, {"pure": FakeView([0.4, 0.35, 0.25]), "rag": rag})
    assert (c.token_id, c.source) == (1, "rag")


def test_entropy_selection_prefers_the_lower_entropy_context():
    # pure is flatter than rag although its top-1 is higher than rag's second choice.
    pure = FakeView([0.4, 0.3, 0.3])
    rag = FakeView([0.05, 0.9, 0.05])
    c = _one(get_policy("entropy"), {"pure": pure, "rag": rag})
    assert (c.token_id, c.source) == (1, "rag")
    h = lambda p: -sum(x * math.log(x) for x in p)  # noqa: E731
    assert entropy_margin(pure.probs, rag.probs) == pytest.approx(h([0.4, 0.3, 0.3]) - h([0.05, 0.9, 0.05]), abs=1e-6)
    assert logprob_margin(pure.probs, rag.probs) == pytest.approx(math.log(0.9) - math.log(0.4), abs=1e-6)


def test_selection_agreement_takes_the_shared_token_without_signals():
    c = _one(get_policy("entropy"), {"pure": FakeView([0.7, 0.3]), "rag": FakeView([0.9, 0.1])})
    assert (c.token_id, c.source, c.signals) == (0, "agree", {})


def test_cad_contrast_rule_and_alpha_zero():
    pure = FakeView([0.1, 0.8, 0.1])
    rag = FakeView([0.45, 0.4, 0.15])
    views = {"pure": pure, "rag": rag}
    assert _one(get_policy("cad", alpha=0.0), views).token_id == 0
    c = _one(get_policy("cad", alpha=0.5), views)
    expected = int(torch.argmax(1.5 * rag.logits - 0.5 * pure.logits))
    assert c.token_id == expected == 0 and c.signals["alpha"] == 0.5
    # A strong contrast can pick a token that neither context ranks first.
    pure = FakeView([0.5, 0.2, 0.3])
    rag = FakeView([0.5, 0.15, 0.35])
    c = _one(get_policy("cad", alpha=5.0), {"pure": pure, "rag": rag})
    assert (c.token_id, c.source) == (2, "mix")


@pytest.mark.parametrize("alpha", [-0.1, float("nan"), "0.5", True])
def test_cad_rejects_bad_alpha(alpha):
    # NaN is refused for every policy option before CAD's own check (issue 29, item 15).
    with pytest.raises(ValueError, match="alpha must be a number >= 0|'alpha' of policy 'cad' must be a number, got"):
        get_policy("cad", alpha=alpha)


def test_adacad_alpha_is_the_jsd_of_the_two_contexts():
    pure = FakeView([0.1, 0.8, 0.1])
    rag = FakeView([0.45, 0.4, 0.15])
    c = _one(get_policy("adacad"), {"pure": pure, "rag": rag})
    a = float(S.jsd(rag.probs, pure.probs))
    assert c.signals["alpha"] == pytest.approx(a, abs=1e-9)
    assert c.token_id == int(torch.argmax((1 + a) * rag.logits - a * pure.logits))
    same = FakeView([0.2, 0.7, 0.1])
    assert _one(get_policy("adacad"), {"pure": same, "rag": same}).signals["alpha"] == pytest.approx(0.0, abs=1e-9)


def test_passage_weights_softmax_or_uniform():
    w = passage_weights([Passage("a", 1.0), Passage("b", 0.0)])
    assert w == pytest.approx([math.e / (math.e + 1), 1 / (math.e + 1)])
    assert passage_weights([Passage("a", 3.0), Passage("b")]) == [0.5, 0.5]
    assert passage_weights([]) == []
    assert passage_weights([Passage("a", 2.0), Passage("b", 0.0)], temperature=2.0) == pytest.approx(w)


def test_rag_token_mixes_passage_distributions():
    views = {
        "passage:0": FakeView([0.5, 0.4, 0.1], weight=0.5),
        "passage:1": FakeView([0.0, 0.45, 0.55], weight=0.5),
    }
    c = _one(get_policy("rag_token"), views)
    # Mixture [0.25, 0.425, 0.325]: token 1, although no passage ranks it first.
    assert c.token_id == 1
    assert c.signals["p_mix"] == pytest.approx(0.425, abs=1e-6)
    assert c.source == "passage:1"
    views["passage:0"].spec.weight, views["passage:1"].spec.weight = 0.9, 0.1
    assert _one(get_policy("rag_token"), views).token_id == 0


def test_policy_contract_has_six_members_and_no_side_channel():
    from tokrag_integrations.policies import base, uses_passages

    members = {n for n in vars(base.Policy) if not n.startswith("_")}
    assert members == {"name", "roles", "contexts", "prepare", "choose", "options"}
    p = base.Policy()
    assert p.options() == {} and uses_passages(p) and not uses_passages(get_policy("no_rag"))
    assert isinstance(get_policy("rag_sequence"), base.SequencePolicy)
    assert not isinstance(get_policy("rag_token"), base.SequencePolicy)


@pytest.mark.parametrize("old,new", [("llm", "no_rag"), ("tokrag_reference", "tokrag_authors")])
def test_a_renamed_policy_is_refused_naming_its_new_name(old, new):
    """The package was never released, so an old name is no alias (house style 11): the error
    names the new one, and the list of names holds only today's."""
    assert new in available_policies() and old not in available_policies()
    with pytest.raises(ValueError, match=rf"Unknown policy '{old}': it is renamed '{new}'\. Available policies: "):
        get_policy(old)
    with pytest.raises(ValueError, match=r"^Unknown policy 'nope'\. Available policies: adacad, "):
        get_policy("nope")
