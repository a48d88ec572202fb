"""The decoding engine: role batches (:mod:`.batch`), their prefill (:mod:`.prefill`), the
step-by-step loop and teacher forcing (:mod:`.loop`), distribution statistics
(:mod:`.stats`). Speed paths live in :mod:`..accel`; the engine does not choose them."""

from .batch import MIN_SHARED_PREFIX, RoleBatch
from .loop import StepEvent, decode_loop, role_setup, step_event, teacher_force, views_for
from .prefill import Prefilled, plain_prefill, prefill_roles, row_map, shared_prefill
from .stats import distribution_stats, distribution_stats_rows

__all__ = [
    "MIN_SHARED_PREFIX",
    "Prefilled",
    "RoleBatch",
    "StepEvent",
    "decode_loop",
    "distribution_stats",
    "distribution_stats_rows",
    "plain_prefill",
    "prefill_roles",
    "role_setup",
    "row_map",
    "shared_prefill",
    "step_event",
    "teacher_force",
    "views_for",
]
