"""Which queries :func:`accel.packed.prefill_groups` prefills together."""

from __future__ import annotations

from tokrag_integrations.accel.packed import prefill_groups
from tokrag_integrations.policies.base import ContextSpec


def _q(*lengths: int) -> dict[str, ContextSpec]:
    return {f"r{i}": ContextSpec(list(range(n))) for i, n in enumerate(lengths)}


def test_long_prompts_are_prefilled_one_query_at_a_time():
    per_query = [_q(60, 840), _q(55, 900), _q(70, 700)]
    assert prefill_groups(per_query, tokens=1024) == [[0], [1], [2]]


def test_short_prompts_share_a_group_up_to_the_padded_budget():
    # Padded positions are queries × the group's longest prompt, whichever context it is.
    per_query = [_q(100), _q(300, 50), _q(200), _q(250), _q(10)]
    assert prefill_groups(per_query, tokens=1000) == [[0, 1, 2], [3, 4]]


def test_a_query_longer_than_the_budget_is_a_group_of_its_own():
    assert prefill_groups([_q(5000), _q(10)], tokens=1024) == [[0], [1]]
    assert prefill_groups([_q(10), _q(5000)], tokens=1024) == [[0], [1]]
    assert prefill_groups([], tokens=1024) == []
