"""``speed={"graphs": "capture"}`` (the static step recorded as CUDA graphs, no compiler), on
the tiny 30-layer model: what can be checked without a GPU.

- The step takes nothing from the host: no tensor made from Python data (``aten.lift_fresh``:
  ``torch.tensor(list)``, a list used as an index), no host read, in any policy's step,
  sampled and constrained included. On CUDA either would fail the recording (a copy from
  pageable memory, a synchronisation) or bake one step's values into the graph.
- Through the engine, with a stand-in for the CUDA side that has a CUDA graph's semantics
  (recording changes no state and fixes every Python value the step computes; a replay runs
  the recorded operations on the buffers they were recorded on): the decode's arguments keep
  their signature from step to step, so one bucket is one eager step, one recording and
  replays, also in the next decode; the tokens equal the eager step's.
- On a CPU the step runs eagerly and the trace says why.
The recording itself on CUDA is the prepared device check's (``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import collections

import pytest
import torch
from _capture import recorded_on_cpu
from _constraints import Digits
from torch.utils._python_dispatch import TorchDispatchMode

from tokrag_integrations import generate, generate_batch
from tokrag_integrations.accel.static_step import static_step
from tokrag_integrations.engine.decoder import Decoder
from tokrag_integrations.engine.sampler import QuerySampling
from tokrag_integrations.policies import get_policy
from tokrag_integrations.prompts import PromptBuilder
from tokrag_integrations.sampling import sampling_of

Q = "Who founded Quillfeather Aerospace, and where?"
PASSAGES = [
    "Quillfeather Aerospace was founded by Ada Brandt in Tromso in 2011.",
    "The company builds small satellites for weather agencies.",
]
CAPTURE = {"static": "on", "fuse": True, "graphs": "capture"}
EAGER = {"static": "on", "fuse": True, "graphs": "off"}
#: What a recorded step must not do: make a tensor from host data, or read one on the host.
FROM_HOST = ("lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "nonzero", "item")


class HostData(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in FROM_HOST:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _plan(lm):
    return PromptBuilder(lm.tokenizer, context_window=lm.context_window).build(Q, PASSAGES)


@pytest.mark.parametrize("policy", ["no_rag", "rag", "floor", "tokrag", "cad", "rag_token"])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_step_takes_nothing_from_the_host(shallow, policy, sampled):
    d = Decoder(shallow, get_policy(policy), max_new_tokens=4, speed="cuda")
    assert d._static is not None, d.static_off
    smp = None
    if sampled:  # drawn tokens, top log-probabilities and one constrained query
        drawn = sampling_of(temperature=0.8, seed=1, top_p=0.9, top_logprobs=3)
        smp = [QuerySampling(drawn, Digits(shallow)), QuerySampling(drawn)]
    d.admit([_plan(shallow)] * 2, sampling=smp)
    st = d._static
    assert st.step_args()[5:8] == ((True, True, True) if sampled else (False, False, False))
    counter = HostData()
    with st.attention(), torch.inference_mode(), counter:
        static_step(*st.step_args())
    assert not counter.ops, dict(counter.ops)


def test_the_counter_sees_host_data():
    counter = HostData()
    x = torch.randn(3, 4)
    with counter:
        x[:, [1, 2]].sum().item()
    assert counter.ops == {"lift_fresh": 1, "_local_scalar_dense": 1}


@pytest.fixture
def stand_in(monkeypatch, tiny):
    with recorded_on_cpu(monkeypatch, tiny) as graphs:
        yield graphs


def _decode(lm, policy: str, n: int) -> Decoder:
    d = Decoder(lm, get_policy(policy), max_new_tokens=n, speed=CAPTURE)
    d.admit([_plan(lm)])
    for _ in range(n):
        if not d.active:
            break
        d.choose()
        d.advance()
    return d


@pytest.mark.parametrize("policy", ["rag", "tokrag"])
def test_one_bucket_is_one_eager_step_one_recording_and_replays(tiny, stand_in, policy):
    d = _decode(tiny, policy, 8)
    steps = len(d.generated[0])
    graphs = d._static.graphs
    assert graphs.counts == {"eager": 1, "recorded": 1, "replayed": steps - 1}
    # The next decode of the same shape (pooled buffers, cached rule): replays from its first step.
    again = _decode(tiny, policy, 8)
    assert again._static.graphs is graphs and again._static.rule is d._static.rule
    assert graphs.counts == {"eager": 1, "recorded": 1, "replayed": 2 * steps - 1}
    want = generate(tiny, Q, PASSAGES, policy=policy, speed=EAGER, max_new_tokens=8)
    got = generate(tiny, Q, PASSAGES, policy=policy, speed=CAPTURE, max_new_tokens=8)
    assert got.token_ids == want.token_ids == d.generated[0] == again.generated[0]
    assert got.trace.timings["cuda_graphs"] == 1.0


def test_another_option_is_another_rule_and_graph(tiny, stand_in):
    first = _decode(tiny, "tokrag", 1)  # one step: eager, nothing recorded
    other = Decoder(tiny, get_policy("tokrag", rising_gate=False), max_new_tokens=4, speed=CAPTURE)
    assert other._static.rule is not first._static.rule
    other.admit([_plan(tiny)])
    other.choose()
    assert first._static.graphs.counts == {"eager": 2, "recorded": 0, "replayed": 0}


def test_batched_queries_with_different_lengths_and_sampling(tiny, stand_in):
    """Queries that leave at different steps and a sampled one: the graph per signature still
    gives the eager step's tokens."""
    qs = [Q, "Where is Tromso?", "What do they build?"]
    kw = dict(policy="tokrag", max_new_tokens=10, seed=3, temperature=0.7)
    want = generate_batch(tiny, qs, [PASSAGES] * 3, speed=EAGER, **kw)
    got = generate_batch(tiny, qs, [PASSAGES] * 3, speed=CAPTURE, **kw)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert sum(s.recorded for s in stand_in.made) >= 1


def test_on_a_cpu_the_step_runs_eagerly_and_the_trace_says_why(tiny):
    r = generate(tiny, Q, PASSAGES, policy="rag", speed=CAPTURE, max_new_tokens=3)
    assert r.trace.timings["static"] == 1.0 and "cuda_graphs" not in r.trace.timings
    why = r.trace.speed["speed_paths_off"]["cuda_graphs"]
    assert "CUDA device" in why and "eagerly" in why
    want = generate(tiny, Q, PASSAGES, policy="rag", speed=EAGER, max_new_tokens=3)
    assert r.token_ids == want.token_ids
