"""The batched chooser (:func:`tokrag_integrations.accel.shared_lens.choose_many`): the
rule's choices without signals are taken as they are, and only the other queries are asked
for lens rows and chosen by the rule."""

from __future__ import annotations

from tokrag_integrations.accel.shared_lens import choose_many
from tokrag_integrations.policies.base import Choice, Policy
from tokrag_integrations.trace import AGREE, FROM_RAG


class Gated(Policy):
    """Query views are ints: even ones are decided without signals."""

    name = "gated"

    def __init__(self) -> None:
        self.asked_rows: list[int] = []
        self.chosen: list[int] = []

    def choice_without_signals(self, views):
        return Choice(100 + views, AGREE) if views % 2 == 0 else None

    def first_lens_rows(self, views):
        self.asked_rows.append(views)
        return None

    def choose(self, views, lm):
        self.chosen.append(views)
        return Choice(200 + views, FROM_RAG)


def test_gated_queries_skip_the_lens_and_the_rule_and_keep_their_order():
    pol = Gated()
    got = choose_many(pol, [0, 1, 2, 3, 5], lm=None)
    assert [c.token_id for c in got] == [100, 201, 102, 203, 205]
    assert pol.asked_rows == [1, 3, 5]
    assert pol.chosen == [1, 3, 5]


def test_a_rule_without_gates_is_asked_for_every_query():
    class Plain(Gated):
        def choice_without_signals(self, views):
            return super(Gated, self).choice_without_signals(views)

    pol = Plain()
    got = choose_many(pol, [0, 1], lm=None)
    assert [c.token_id for c in got] == [200, 201]
    assert pol.asked_rows == [0, 1] and pol.chosen == [0, 1]
