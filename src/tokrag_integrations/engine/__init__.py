"""The decoding engine: role batches (:mod:`.batch`), their prefill (:mod:`.prefill`), what
a policy sees of each context (:mod:`.view`), the step loop as an object that admits queries between steps (:mod:`.decoder`), the
step-by-step loop and teacher forcing (:mod:`.loop`), the loop of sequence-level rules (:mod:`.sequence`), distribution statistics
(:mod:`.stats`) and the ``speed=`` argument (:mod:`.speed`). Speed paths live in
:mod:`..accel`; the engine does not choose them."""

from .batch import MIN_SHARED_PREFIX, RoleBatch
from .decoder import Decoder
from .loop import StepEvent, decode_loop, role_setup, step_event, teacher_force, views_for
from .prefill import Prefilled, plain_prefill, prefill_roles, row_map, shared_prefill
from .sequence import decode_sequence
from .speed import Speed, speed_of
from .stats import distribution_stats, distribution_stats_rows
from .view import ContextView

__all__ = [
    "MIN_SHARED_PREFIX",
    "ContextView",
    "Decoder",
    "Prefilled",
    "RoleBatch",
    "Speed",
    "StepEvent",
    "decode_loop",
    "decode_sequence",
    "distribution_stats",
    "distribution_stats_rows",
    "plain_prefill",
    "prefill_roles",
    "role_setup",
    "row_map",
    "shared_prefill",
    "speed_of",
    "step_event",
    "teacher_force",
    "views_for",
]
