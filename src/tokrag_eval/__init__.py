"""The research harness, apart from the runtime library: noise sweep (Tok-RAG Table 1),
misleading passages, token-level benefit/detriment classification (Table 3) and cost
(Table 6) over JSONL evaluation sets, and the ``tokrag eval`` / ``tokrag bench`` commands
(:mod:`.commands`, registered through the ``tokrag.commands`` entry-point group). Installed with
the ``eval`` extra (``pip install "tokrag-integrations[eval]"``). It imports
:mod:`tokrag_integrations`; the runtime package never imports it.

    >>> import json
    >>> from tokrag_integrations import load_model
    >>> from tokrag_eval import load_items, run_noise_sweep
    >>> item = {"id": "q1", "question": "Who founded Quillfeather Aerospace?",
    ...         "answers": ["Ottoline Varga"],
    ...         "positives": ["Quillfeather Aerospace was founded in 1994 by Ottoline Varga."],
    ...         "negatives": ["Quillfeather's first rocket flew in 2003."]}
    >>> with open("items.jsonl", "w") as f:     # your set, e.g. shared/data/squad_dev.jsonl
    ...     _ = f.write(json.dumps(item) + "\\n")
    >>> items = load_items("items.jsonl", limit=20)
    >>> summary = run_noise_sweep(load_model(), items, ratios=[0.0], k=1, policies=["rag", "tokrag"],
    ...                           records_path="runs/sweep.jsonl", max_new_tokens=8)

Data format: ``shared/data/README.md``. Every runner appends one JSON line per
(item id, condition, policy) to a records file and skips the keys already there, so an
interrupted run continues where it stopped. Policies are specs (``tokrag[min_fusion_layer=0]``,
:mod:`.specs`); accuracy and AUC come with 95 % bootstrap intervals over items.
"""

from __future__ import annotations

from .accuracy import compare_policies, summarize_accuracy
from .data import (
    EvalItem,
    load_items,
    mix_counterfactuals,
    mix_passages,
    select_popular,
    synthesize_popqa,
)
from .harness import run_misleading, run_noise_sweep
from .metrics import (
    auc,
    bootstrap_auc_ci,
    bootstrap_ci,
    cover_em,
    f1_score,
    normalize_answer,
    paired_bootstrap_diff,
)
from .records import RecordStore
from .specs import PolicySpec, parse_spec, parse_specs
from .token_level import pool_token_records, run_token_level, scorer_configs, summarize_token_level

__all__ = [
    "EvalItem",
    "PolicySpec",
    "RecordStore",
    "auc",
    "bootstrap_auc_ci",
    "bootstrap_ci",
    "compare_policies",
    "cover_em",
    "f1_score",
    "load_items",
    "mix_counterfactuals",
    "mix_passages",
    "normalize_answer",
    "paired_bootstrap_diff",
    "parse_spec",
    "parse_specs",
    "pool_token_records",
    "run_misleading",
    "run_noise_sweep",
    "run_token_level",
    "scorer_configs",
    "select_popular",
    "summarize_accuracy",
    "summarize_token_level",
    "synthesize_popqa",
]
