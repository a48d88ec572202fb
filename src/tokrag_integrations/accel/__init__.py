"""The speed paths, behind one seam (CPU speed work only; the algorithm never imports this).

* :mod:`.cpu_kernels`: few-row linear layers routed to the fastest measured kernel;
  :mod:`.sdpa`: the ``tokrag_sdpa`` attention (grouped, row-wise, packed two-context
  prefill); :mod:`.lens_head`: the packed LM head of the logit lens; all installed by
  :func:`.paths.maybe_install`, the one function ``load_model`` calls (:func:`install_kernels`
  here).
* :mod:`.kv_cache`: a KV cache layer that grows in place (every role batch uses it).
* :mod:`.packed`: all contexts of a decode in one pass per step (packed or fused);
  :func:`prefill` is what the runner hands to the step-by-step loop.

Which of them a decode uses is its :class:`..engine.speed.Speed` (the ``speed=`` argument of
the runner and the API).

The functions here import their module on first use, so that importing
:mod:`.kv_cache` (as the engine's batch does) stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ..engine.batch import RoleBatch
    from ..engine.prefill import Prefilled
    from ..engine.speed import Speed
    from ..models import LoadedModel
    from ..policies.base import ContextSpec


def install_kernels(model: Any, mode: str | None = None) -> bool:
    """Install the CPU kernels on ``model`` where they apply (``mode`` ``auto``/``on``/
    ``off``, default ``TOKRAG_CPU_KERNELS``): :func:`.paths.maybe_install`, which
    ``load_model`` calls (from the module, since this package's loops import ``models``)."""
    from .paths import maybe_install

    return maybe_install(model, mode)


def speed_paths(model: Any) -> dict[str, str]:
    """``on`` or ``off: <reason>`` per speed path of ``model``."""
    from .paths import speed_paths as paths

    return paths(model)


def prefill(
    roles: Sequence[str],
    per_query: Sequence[dict[str, ContextSpec]],
    lm: LoadedModel,
    probe_roles: frozenset[str],
    speed: Speed | None = None,
    pack: bool = True,
) -> Prefilled:
    """The step-by-step loop's prefill with packed / fused contexts where ``speed.fuse``
    (:func:`.packed.prefill`; ``pack=False``: no packed sequence, rows that
    :func:`join_batches` can merge)."""
    from .packed import prefill as packed_prefill

    return packed_prefill(roles, per_query, lm, probe_roles, speed, pack)


def join_batches(running: RoleBatch, new: RoleBatch) -> RoleBatch | None:
    """A running batch and a newly prefilled one as one batch, or None
    (:func:`.packed.join_batches`)."""
    from .packed import join_batches as join

    return join(running, new)
