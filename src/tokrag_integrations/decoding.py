"""Compatibility names: the engine moved to :mod:`.engine` (batch, prefill, loop, stats) and
the policy contract to :mod:`.policies.base`. New code imports from those."""

from .engine.batch import MIN_SHARED_PREFIX, RoleBatch, _RoleBatch
from .engine.loop import StepEvent, decode_loop, step_event, teacher_force
from .engine.prefill import _SHARED_PREFILL, prefill_roles, shared_prefill
from .engine.stats import distribution_stats, distribution_stats_rows
from .policies.base import Choice, ContextSpec, ContextView, Policy

__all__ = [
    "MIN_SHARED_PREFIX",
    "_SHARED_PREFILL",
    "Choice",
    "ContextSpec",
    "ContextView",
    "Policy",
    "RoleBatch",
    "StepEvent",
    "_RoleBatch",
    "decode_loop",
    "distribution_stats",
    "distribution_stats_rows",
    "prefill_roles",
    "shared_prefill",
    "step_event",
    "teacher_force",
]
