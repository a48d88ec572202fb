"""Evaluation harness: noise sweep (Tok-RAG Table 1), misleading passages, token-level
benefit/detriment classification (Table 3) and cost (Table 6) over JSONL evaluation sets.

    >>> from tokrag_integrations.evaluation import load_items, run_noise_sweep
    >>> items = load_items("shared/data/squad_dev.jsonl", limit=20)
    >>> summary = run_noise_sweep(lm, items, policies=["rag", "tokrag"], out_dir="runs/squad")

Data format: ``shared/data/README.md``. Every runner appends one JSON line per
(item id, condition, policy) to a records file and skips the keys already there, so an
interrupted run continues where it stopped.
"""

from __future__ import annotations

from .data import EvalItem, load_items, mix_counterfactuals, mix_passages
from .metrics import auc, cover_em, f1_score, normalize_answer
from .runner import (
    RecordStore,
    run_misleading,
    run_noise_sweep,
    run_token_level,
    summarize_accuracy,
    summarize_token_level,
)

__all__ = [
    "EvalItem",
    "RecordStore",
    "auc",
    "cover_em",
    "f1_score",
    "load_items",
    "mix_counterfactuals",
    "mix_passages",
    "normalize_answer",
    "run_misleading",
    "run_noise_sweep",
    "run_token_level",
    "summarize_accuracy",
    "summarize_token_level",
]
