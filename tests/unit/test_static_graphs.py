"""``StepGraphs`` (``Speed.graphs="capture"``): which step runs eagerly, which is recorded, which
replays, on a small in-place step and a stand-in for the CUDA side (recording does not run the
step, as on CUDA; a replay runs it on the arguments it was recorded on)."""

from __future__ import annotations

import pytest
import torch

from tokrag_integrations.accel.static_graphs import StepGraphs, capture_off_reason, signature


class StandIn:
    """The CUDA side of :class:`StepGraphs` on CPU: ``record`` keeps the arguments and runs
    nothing; a replay runs the step on exactly those arguments."""

    def __init__(self) -> None:
        self.recorded: list[tuple] = []

    def eager(self, fn, args):
        return fn(*args)

    def record(self, fn, args):
        self.recorded.append(args)
        return lambda: fn(*args)


def step(ids: torch.Tensor, pos: torch.Tensor, scale: int, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A step that updates its buffers in place, as the static step does."""
    bufs["acc"].add_(ids * scale)
    pos.add_(1)
    ids.copy_((ids * 3 + pos) % 7)
    return bufs["acc"].clone()


def fresh() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    return torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.long), {"acc": torch.zeros(3, dtype=torch.long)}


def test_first_step_eager_second_recorded_then_replayed_with_the_eager_results():
    ids, pos, bufs = fresh()
    want_ids, want_pos, want_bufs = fresh()
    backend = StandIn()
    graphs = StepGraphs(step, backend)
    for _ in range(6):
        assert torch.equal(graphs(ids, pos, 2, bufs), step(want_ids, want_pos, 2, want_bufs))
    assert torch.equal(ids, want_ids) and torch.equal(pos, want_pos)
    assert graphs.counts == {"eager": 1, "recorded": 1, "replayed": 5}
    assert len(backend.recorded) == 1 and backend.recorded[0][0] is ids
    (entry,) = graphs.graphs.values()
    assert entry is not None and entry[1][0] is ids  # the graph keeps its arguments alive


def test_a_new_flag_or_new_buffers_are_a_new_graph_never_a_replay_of_the_old_one():
    ids, pos, bufs = fresh()
    graphs = StepGraphs(step, StandIn())
    graphs(ids, pos, 2, bufs)
    graphs(ids, pos, 2, bufs)  # recorded
    graphs(ids, pos, 5, bufs)  # another flag: eager first
    assert graphs.counts == {"eager": 2, "recorded": 1, "replayed": 1}
    ids2, pos2, bufs2 = fresh()  # the same values in other tensors (a grown state)
    got = graphs(ids2, pos2, 2, bufs2)
    assert graphs.counts["eager"] == 3
    assert torch.equal(got, torch.tensor([2, 4, 6]))  # computed on the new buffers
    narrower = ids[:2]  # a view at the same address but another shape
    assert signature((narrower,)) != signature((ids,))


def test_the_least_recently_replayed_graph_goes_first():
    graphs = StepGraphs(step, StandIn(), max_graphs=2)
    ids, pos, bufs = fresh()
    for scale in (1, 2, 1, 3):
        graphs(ids, pos, scale, bufs)
    assert len(graphs.graphs) == 2
    graphs(ids, pos, 2, bufs)  # scale 2 was dropped: eager again
    assert graphs.counts["eager"] == 4


def test_capture_needs_a_cuda_device():
    assert capture_off_reason(torch.device("cuda", 0)) is None
    why = capture_off_reason(torch.device("cpu"))
    assert why is not None and "CUDA device" in why and "eagerly" in why


class Refusing(StandIn):
    def record(self, fn, args):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_recording_warns_and_that_signature_runs_eagerly():
    ids, pos, bufs = fresh()
    want_ids, want_pos, want_bufs = fresh()
    graphs = StepGraphs(step, Refusing())
    graphs(ids, pos, 2, bufs)
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        got = graphs(ids, pos, 2, bufs)
    for _ in range(3):
        got = graphs(ids, pos, 2, bufs)
    for _ in range(5):
        want = step(want_ids, want_pos, 2, want_bufs)
    assert torch.equal(got, want) and torch.equal(ids, want_ids)
    assert graphs.counts == {"eager": 5, "recorded": 0, "replayed": 0}
    assert graphs.failed == ["RuntimeError: operation not permitted when stream is capturing"]
