"""load_model: clear errors for what cannot be loaded or read.

Cases that need no model, database or server are in ``tests/unit/test_models.py``."""

from __future__ import annotations

import pytest

from tokrag_integrations import load_model


def test_architecture_the_signals_cannot_read(tmp_path, lm):
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2 fuses Q, K and V into one projection: the attention rows cannot be recomputed.
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=lm.vocab_size)).save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="signals cannot read this architecture.*require_signals=False"):
        load_model(str(tmp_path), device="cpu")
    # The policies that need no signals still work on it.
    from tokrag_integrations import generate

    other = load_model(str(tmp_path), device="cpu", require_signals=False)
    r = generate(other, "Q?", ["P."], policy="rag", max_new_tokens=3)
    assert len(r.trace.steps) >= 1


# ------------------------------------------------------------------ model specs (issue 22)
def _tiny_qwen2(vocab_size: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, initializer_range=0.2,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory, lm):
    """A random-weight Qwen2-style model saved with the default model's tokenizer (~7 MB)."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    _tiny_qwen2(lm.vocab_size).save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return folder


def test_folder_in_bfloat16_answers_with_every_policy(qwen2_folder):
    import torch

    from tokrag_integrations import generate
    from tokrag_integrations.policies import available_policies

    tiny = load_model(qwen2_folder, dtype="bfloat16", device="cpu")
    assert next(tiny.model.parameters()).dtype == torch.bfloat16
    assert tiny.name == qwen2_folder.name and tiny.is_chat
    for policy in available_policies():
        r = generate(tiny, "Who?", ["Ann wrote it.", "Bob read it."], policy=policy, max_new_tokens=3)
        assert r.trace.steps, policy


def test_hub_id_is_read_from_the_cache_offline(qwen2_folder, tmp_path, monkeypatch):
    import shutil

    from huggingface_hub import constants

    # The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen2"
    shutil.copytree(qwen2_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    tiny = load_model("tiny-org/tiny-qwen2", device="cpu")
    assert tiny.name == "tiny-org/tiny-qwen2" and commit in tiny.path
    assert load_model("tiny-org/tiny-qwen2", revision=commit, device="cpu").name == "tiny-org/tiny-qwen2"
    with pytest.raises(FileNotFoundError, match=r"not-cached/model.*huggingface-cli download not-cached/model"):
        load_model("not-cached/model")
    with pytest.raises(FileNotFoundError, match="huggingface-cli download"):
        load_model("tiny-org/tiny-qwen2", revision="v9")


def test_loaded_model_and_tokenizer(lm):
    from tokrag_integrations import generate

    model = _tiny_qwen2(lm.vocab_size)
    tiny = load_model(model, tokenizer=lm.tokenizer)
    assert tiny.model is model and tiny.tokenizer is lm.tokenizer
    assert generate(tiny, "Q?", ["P."], policy="tokrag", max_new_tokens=2).trace.steps
    with pytest.raises(ValueError, match="needs its tokenizer"):
        load_model(_tiny_qwen2(lm.vocab_size))
    with pytest.raises(ValueError, match="already loaded"):
        load_model(model, tokenizer=lm.tokenizer, device_map="auto")
    with pytest.raises(TypeError, match="not int"):
        load_model(3)


def test_options_reach_from_pretrained_and_typos_raise(qwen2_folder):
    tiny = load_model(
        qwen2_folder,
        device="cpu",
        model_kwargs={"attn_implementation": "eager"},
        tokenizer_kwargs={"padding_side": "left"},
        cpu_kernels="off",
    )
    assert tiny.model.config._attn_implementation == "eager"
    assert tiny.tokenizer.padding_side == "left"
    with pytest.raises(TypeError, match="device_mapp"):
        load_model(qwen2_folder, device_mapp="auto")
    with pytest.raises(ValueError, match="device.*device_map.*not both"):
        load_model(qwen2_folder, device="cpu", device_map="auto")
    with pytest.raises(ValueError, match=r"model_kwargs\['torch_dtype'\].*dtype="):
        load_model(qwen2_folder, model_kwargs={"torch_dtype": "bfloat16"})
    placed = load_model(qwen2_folder, device_map="cpu", dtype="float32")
    assert placed.device.type == "cpu"


def test_loading_changes_no_environment_variable(qwen2_folder, monkeypatch):
    import os

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    load_model(qwen2_folder, device="cpu")
    load_model("default", device="cpu", cpu_kernels="off")
    assert dict(os.environ) == before


def test_a_model_spread_over_several_gpus_is_refused_for_signals(lm):
    model = _tiny_qwen2(lm.vocab_size)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1}
    with pytest.raises(ValueError, match="spread over 2 devices.*require_signals=False"):
        load_model(model, tokenizer=lm.tokenizer)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": "cpu", "model.layers.1": "disk"}
    assert load_model(model, tokenizer=lm.tokenizer).model is model
