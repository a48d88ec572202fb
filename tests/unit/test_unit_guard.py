"""The guard of ``tests/unit`` (``tests/_unit_guard.py``) refuses what only an integration
test may do, and lets ordinary work through."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _unit_guard import UnitGuardError, guarded


def test_loading_a_real_model_is_refused_and_recorded(tmp_path):
    from transformers import LlamaForCausalLM

    seen: list[str] = []
    with guarded(seen), pytest.raises(UnitGuardError, match="tests/integration"):
        LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert len(seen) == 1 and "LlamaForCausalLM.from_pretrained" in seen[0]


def test_starting_the_embedded_postgres_is_refused(tmp_path):
    from tokrag_integrations.postgres.embedded import start_embedded

    seen: list[str] = []
    with guarded(seen), pytest.raises(Exception, match="a unit test started the embedded Postgres"):
        start_embedded(tmp_path / "pg")  # (start_embedded wraps the refusal in its own error)
    assert seen == ["started the embedded Postgres"]


@pytest.mark.parametrize(
    "argv",
    [
        ["tokrag", "ask", "Who?"],
        [sys.executable, "-m", "tokrag_integrations.cli", "--version"],
        [sys.executable, "-c", "from tokrag_integrations import load_model; load_model()"],
    ],
)
def test_running_the_cli_or_a_model_in_a_subprocess_is_refused(argv):
    seen: list[str] = []
    with guarded(seen), pytest.raises(UnitGuardError, match="subprocess"):
        subprocess.run(argv, check=False)
    assert len(seen) == 1


def test_ordinary_work_goes_through_and_the_patches_are_undone():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_utils import PreTrainedModel

    from tokrag_integrations.postgres import embedded

    def state():
        return (PreTrainedModel.__dict__["from_pretrained"], embedded._server_class,
                subprocess.Popen.__init__)

    before = state()
    seen: list[str] = []
    with guarded(seen):
        config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        logits = LlamaForCausalLM(config)(torch.tensor([[1, 2, 3]])).logits  # a hand-built model
        out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
    assert logits.shape == (1, 3, 32) and out.stdout.strip() == "42" and seen == []
    assert state() == before
