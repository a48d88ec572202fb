"""Boolean options are read strictly (issue 29, item 1).

``bool("False")`` is ``True``: a boolean option given as a string must be refused, never read
by its truthiness. Every case fails before anything is loaded or connected, so no model,
database or network is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _helpers import require

STRINGS = ["False", "false", "0", "", "no"]


def _remote_code_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder whose config.json points at its own Python code (``auto_map``); importing
    that code writes a marker file."""
    folder = tmp_path / "evil_model"
    folder.mkdir()
    marker = tmp_path / "remote_code_ran"
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil",
                "architectures": ["EvilForCausalLM"],
                "auto_map": {
                    "AutoConfig": "evil.EvilConfig",
                    "AutoModelForCausalLM": "evil.EvilForCausalLM",
                },
            }
        )
    )
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig, PreTrainedModel\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
        "class EvilForCausalLM(PreTrainedModel):\n    config_class = EvilConfig\n"
    )
    return folder, marker


@pytest.mark.parametrize("value", ["False", "false", "0", 0])
def test_trust_remote_code_string_never_runs_folder_code(tmp_path, value):
    from tokrag_integrations import load_model

    folder, marker = _remote_code_folder(tmp_path)
    with pytest.raises(TypeError, match="trust_remote_code must be True or False"):
        load_model(folder, trust_remote_code=value)
    assert not marker.exists()


def _entry_points(tmp_path: Path) -> dict[str, tuple[object, str]]:
    """Public entry point -> (a call with one boolean option given as ``value``, its name)."""
    import torch

    from tokrag_eval import cost, harness, token_level
    from tokrag_integrations import load_model, models, retrieval
    from tokrag_integrations.engine import scheduler as batching
    from tokrag_integrations.gating.ctrla import CtrlAMonitorPolicy
    from tokrag_integrations.policies.tokrag import TokRAG
    from tokrag_integrations.postgres import ingest
    from tokrag_integrations.postgres.connection import ResolvedDatabase
    from tokrag_integrations.postgres.frameworks import make_llamaindex_store
    from tokrag_integrations.postgres.layout import TableLayout

    doc = tmp_path / "a.md"
    doc.write_text("# A\n\nText.\n")
    unreachable = "postgresql://alice@127.0.0.1:1/rag"
    db = ResolvedDatabase(dsn=unreachable, origin="argument")
    records = tmp_path / "records.jsonl"
    return {
        "load_model local_files_only": (lambda v: load_model("nowhere", local_files_only=v), "local_files_only"),
        "load_model require_signals": (lambda v: load_model("nowhere", require_signals=v), "require_signals"),
        "show_loading_progress": (lambda v: models.show_loading_progress(v), "enabled"),
        "ingest prune": (lambda v: ingest([doc], dsn=unreachable, prune=v), "prune"),
        "ingest progress": (lambda v: ingest([doc], dsn=unreachable, progress=v), "progress"),
        "make_llamaindex_store setup": (
            lambda v: make_llamaindex_store(db, TableLayout.for_target("t"), 384, setup=v),
            "setup",
        ),
        "batching.generate": (lambda v: batching.generate(None, "q", batching=v), "batching"),
        "build_retriever progress": (
            lambda v: retrieval.build_retriever([doc], kind="bm25", progress=v),
            "progress",
        ),
        "DenseRetriever progress": (lambda v: retrieval.DenseRetriever([], progress=v), "progress"),
        "run_bench memory": (lambda v: cost.run_bench(memory=v), "memory"),
        "run_noise_sweep keep_traces": (
            lambda v: harness.run_noise_sweep(None, [], records_path=records, keep_traces=v),
            "keep_traces",
        ),
        "run_token_level progress": (
            lambda v: token_level.run_token_level(None, [], records_path=records, progress=v),
            "progress",
        ),
        "TokRAG lens_norm": (lambda v: TokRAG(lens_norm=v), "lens_norm"),
        "CtrlAMonitorPolicy stop_on_trigger": (
            lambda v: CtrlAMonitorPolicy(torch.zeros(4), [0], "q", stop_on_trigger=v),
            "stop_on_trigger",
        ),
    }


@pytest.mark.parametrize("value", STRINGS)
def test_boolean_options_refuse_strings(tmp_path, value):
    for label, (call, name) in _entry_points(tmp_path).items():
        with pytest.raises((TypeError, ValueError), match=f"{name} must be True or False") as info:
            call(value)
        assert info.type is not ValueError or label.startswith("TokRAG"), label


@pytest.mark.parametrize("value", ["False", "0"])
def test_adapter_boolean_options_refuse_strings(value):
    """The LlamaIndex and LangChain classes refuse before any model is loaded."""
    require("llama_index.core", "llama-index-core")
    require("langchain_core", "langchain-core")
    from pydantic import ValidationError

    from tokrag_integrations.langchain import ChatTokRAG
    from tokrag_integrations.llama_index import TokRAGLLM, TokRAGSynthesizer

    for name in ("streaming", "batching"):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            TokRAGSynthesizer(**{name: value})
    with pytest.raises(ValidationError, match="valid boolean"):
        TokRAGSynthesizer(trust_remote_code=value, model="nowhere")
    for name in ("trust_remote_code", "batching"):
        with pytest.raises(ValidationError, match="valid boolean"):
            TokRAGLLM(**{name: value})
    for name in ("trust_remote_code", "streaming", "batching"):
        with pytest.raises(ValidationError, match="valid boolean"):
            ChatTokRAG(**{name: value})


def _switch_readers() -> dict[str, object]:
    """Environment variable -> the package's own reading of it (True = on)."""
    from tokrag_integrations.config import env_switch
    from tokrag_integrations.speed import Speed

    return {
        "TOKRAG_FUSE_CONTEXTS": lambda: Speed().fuse,
        "TOKRAG_PACKED_PREFILL": lambda: Speed().packed_prefill,
        "TOKRAG_KERNEL_PLAN_CACHE": lambda: Speed().kernel_plan_cache,
        "TOKRAG_VERBOSE": lambda: env_switch("TOKRAG_VERBOSE", False),  # models.files._loading_quietly
    }


@pytest.mark.parametrize(
    "name", ["TOKRAG_FUSE_CONTEXTS", "TOKRAG_PACKED_PREFILL", "TOKRAG_KERNEL_PLAN_CACHE", "TOKRAG_VERBOSE"]
)
def test_environment_switches_are_read_strictly(monkeypatch, name):
    """Environment switches take the documented words only; 'false' is off (TOKRAG_VERBOSE
    used to read it as on) and a word such as 'nope' is an error naming the variable."""
    read = _switch_readers()[name]
    for text, value in [("0", False), ("false", False), ("OFF", False), ("no", False),
                        ("1", True), ("true", True), ("On", True), (" yes ", True)]:  # fmt: skip
        monkeypatch.setenv(name, text)
        assert read() is value, text
    monkeypatch.setenv(name, "nope")
    with pytest.raises(ValueError, match=f"{name}='nope' is not a switch"):
        read()


def test_verbose_false_keeps_loading_quiet(monkeypatch):
    from tokrag_integrations import models

    require("transformers")
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("TOKRAG_VERBOSE", "false")
    hf_logging.enable_progress_bar()
    with models.files._loading_quietly():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
