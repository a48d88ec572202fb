"""The device rules of issue 56 (item 3): each policy's equations on tensors of fixed shape,
branch-free (``torch.where`` and masks, no host read), one module per policy family; each
module says which equations of which policy module it computes. The policies' own modules
stay the readable reference; :func:`rule_for` maps a policy to its rule (None: none yet, or
an option combination no rule covers)."""

from __future__ import annotations

from typing import Any


def rule_for(policy: Any, lm: Any, *, citations: bool | None, passages: int) -> Any:
    """The device rule of ``policy`` (see :func:`..step_tensors.device_rule_for`)."""
    from . import baselines_rule, cad_rule, rag_token_rule, selection_rule, tokrag_rule

    builders: list[Any] = [
        baselines_rule.build,
        tokrag_rule.build,
        cad_rule.build,
        selection_rule.build,
        rag_token_rule.build,
    ]
    for build in builders:
        rule = build(policy, lm, citations=citations, passages=passages)
        if rule is not None:
            return rule
    return None
