"""Every decode keeps its tensors on the model's device, checked on CPU by
``tests/_device_check.py`` (a GPU raises where a host tensor meets a device tensor; the CPU
does not, so without this check only a GPU run finds such a tensor)."""

from __future__ import annotations

import pytest
import torch
from _device_check import DeviceCheck
from _helpers import slow_except

from tokrag_integrations import generate, generate_batch
from tokrag_integrations.policies import available_policies

from .test_stock_exactness import exactness_prompts


@pytest.fixture(scope="module")
def prompts():
    return exactness_prompts()[:3]


def test_the_check_fails_where_a_gpu_would(lm):
    weight = lm.model.get_input_embeddings().weight
    with DeviceCheck(lm.model), pytest.raises(RuntimeError, match="mixes device tensors with host"):
        torch.ones(2, weight.shape[1]) @ weight.T
    with DeviceCheck(lm.model), pytest.raises(RuntimeError, match="indexed by device indices"):
        torch.zeros(weight.shape[0], dtype=torch.bool)[weight[:2, 0].long().abs()]
    with DeviceCheck(lm.model):  # made on the model's device, or a host scalar: fine
        torch.ones(2, weight.shape[1], device=weight.device) @ weight.T
        weight[:2] * torch.tensor(2.0)


@pytest.mark.parametrize("policy", slow_except(available_policies(), "tokrag", "rag_sequence"))
def test_every_policy_decodes_on_the_models_device(lm, prompts, policy):
    q, ps = prompts[1]
    with DeviceCheck(lm.model):
        r = generate(lm, q, ps, policy=policy, max_new_tokens=4)
    assert r.token_ids


@pytest.mark.parametrize("policy", slow_except(available_policies(), "tokrag", "rag_token"))
def test_every_policy_decodes_on_the_models_device_with_the_static_state(lm, prompts, policy):
    """``speed="cuda"``: the static state's buffers and every tensor of its step (or, for a
    policy without a device rule, the view path it falls back to)."""
    q, ps = prompts[1]
    with DeviceCheck(lm.model):
        r = generate(lm, q, ps, policy=policy, speed="cuda", max_new_tokens=4, citations=True)
    assert r.token_ids


@pytest.mark.parametrize("speed", ["reference", None, "cuda"])
def test_tokrag_solo_and_batched_on_the_models_device(lm, prompts, speed):
    kw = {"speed": speed} if speed else {}
    with DeviceCheck(lm.model):
        one = generate(lm, prompts[0][0], prompts[0][1], policy="tokrag", max_new_tokens=6, **kw)
        many = generate_batch(
            lm, [q for q, _ in prompts], [p for _, p in prompts], policy="tokrag", max_new_tokens=6, **kw
        )
    assert one.token_ids and all(r.token_ids for r in many)
