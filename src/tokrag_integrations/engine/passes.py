"""Model passes that are not a decode, for the rooms that need one (the model runs in the
engine only): the residual states of prompts' last positions (:func:`last_token_states`,
CtrlA's directions) and the gradient of an answer's loss (:func:`loss_gradient`, GECE's
``grad_ins``). A decode, sampled drafts included, runs on the step loop (:mod:`.scheduler`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..contexts.batch import RoleBatch
from ..models import LoadedModel
from ..policies.base import ContextSpec

__all__ = ["last_token_states", "loss_gradient"]


def last_token_states(
    lm: LoadedModel, prompts: Sequence[list[int]], batch_size: int = 16
) -> torch.Tensor:
    """[N, L+1, d] residual states of each prompt's last position (h^0 = embeddings), from
    probed prefills of left-padded batches (:class:`..contexts.batch.RoleBatch`)."""
    out = []
    for i in range(0, len(prompts), batch_size):
        members = [(r, ContextSpec(list(p))) for r, p in enumerate(prompts[i : i + batch_size])]
        with lm.lock, torch.inference_mode():
            batch = RoleBatch("states", members, lm, probe=True)
            batch.forward(None)
        out.append(batch.records.resid.float().cpu().transpose(0, 1))  # [B, L+1, d]
    return torch.cat(out)


def loss_gradient(
    lm: LoadedModel,
    prompt_ids: Sequence[int],
    answer_ids: Sequence[int],
    params: Sequence[torch.nn.Parameter],
) -> list[torch.Tensor]:
    """d loss / d ``params`` (float32, on the CPU) for the LM loss of ``answer_ids`` after
    ``prompt_ids``: the mean token cross-entropy of the answer tokens (the prompt's tokens are
    context only), as in fine-tuning on (prompt -> answer); one pass without a KV cache."""
    prompt, answer = list(prompt_ids), list(answer_ids)
    ids = torch.tensor([prompt + answer], dtype=torch.long, device=lm.model.device)
    labels = ids.clone()
    labels[:, : len(prompt)] = -100
    with lm.lock, torch.enable_grad():
        out = lm.model(input_ids=ids, use_cache=False)
        logits = out.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        grads = torch.autograd.grad(loss, list(params))
    return [g.detach().float().cpu() for g in grads]
