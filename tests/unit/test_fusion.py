"""Reciprocal rank fusion (:mod:`tokrag_integrations.retrieval.fusion`), the one fusion of the
folder retrievers' ``hybrid`` and Postgres ``search="hybrid"``, and the ``retriever`` option's
checks. The fusion on real rankings: tests/integration/test_retrieval.py (folders) and
tests/integration/test_pg_search.py (Postgres)."""

from __future__ import annotations

import contextlib
import io

import pytest

from tokrag_integrations.retrieval.fusion import (
    CANDIDATES,
    RRF_K,
    check_fusion,
    reciprocal_rank_fusion,
)


def test_scores_are_weighted_reciprocal_ranks() -> None:
    fused = dict(reciprocal_rank_fusion([["a", "b", "c"], ["c", "d"]], (1.0, 2.0), rrf_k=10))
    assert fused == pytest.approx({"a": 1 / 11, "b": 1 / 12, "c": 1 / 13 + 2 / 11, "d": 2 / 12})
    order = [item for item, _ in reciprocal_rank_fusion([["a", "b", "c"], ["c", "d"]], (1, 2), 10)]
    assert order == ["c", "d", "a", "b"]


def test_defaults_ties_and_weights() -> None:
    assert (RRF_K, CANDIDATES) == (60.0, 50)
    # x: ranks 1 and 2; y: ranks 2 and 1 -> equal scores; the smaller item first, whatever
    # the order of the rankings
    for rankings in ([[3, 7], [7, 3]], [[7, 3], [3, 7]]):
        fused = reciprocal_rank_fusion(rankings, (1, 1))
        assert [i for i, _ in fused] == [3, 7] and fused[0][1] == fused[1][1]
    # a weight of 0 keeps its items (score 0), ranked after every item with a score
    fused = reciprocal_rank_fusion([["p", "q"], ["r"]], (0, 1))
    assert [i for i, _ in fused] == ["r", "p", "q"] and fused[1][1] == 0
    assert reciprocal_rank_fusion([[], []], (1, 1)) == []
    with pytest.raises(ValueError, match="2 rankings but 1 weights"):
        reciprocal_rank_fusion([["a"], ["b"]], (1,))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1, 1), "rrf_k must be positive"),
        ((60, -1, 1), "vector_weight must be >= 0"),
        ((60, 1, float("inf")), "text_weight must be >= 0 and finite"),
        ((60, True, 1), "vector_weight must be a number"),
        ((60, 0, 0), "both 0"),
    ],
)
def test_check_fusion_refuses(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_fusion(*args)


def test_postgres_fuses_with_the_same_function() -> None:
    """Postgres hybrid search fuses the candidate rows its statement returns with this very
    function: (node_id, text, metadata, vector rank, text rank) -> (..., fused score)."""
    from tokrag_integrations.postgres import search, store
    from tokrag_integrations.retrieval import fusion

    assert search.reciprocal_rank_fusion is fusion.reciprocal_rank_fusion
    assert store.check_fusion is fusion.check_fusion
    rows = [  # (row key, node_id, text, metadata, vector rank, text rank)
        (30, "n1", "t1", {}, 1, None),  # vector only
        (20, "n2", "t2", {}, 2, 1),  # both
        (10, "n3", "t3", {}, None, 2),  # text only
        (5, "n4", "t4", {}, 3, None),  # vector only
    ]
    fused = search.fuse_rows(rows, top_k=2, rrf_k=60, vector_weight=1, text_weight=1)
    assert fused == [("n2", "t2", {}, 1 / 62 + 1 / 61), ("n1", "t1", {}, 1 / 61)]
    text_only = search.fuse_rows(rows, top_k=4, rrf_k=1, vector_weight=0, text_weight=1)
    assert [r[0] for r in text_only] == ["n2", "n3", "n4", "n1"]  # score 0: by row key


def test_unknown_retriever_is_a_clear_error(tmp_path) -> None:
    from pydantic import ValidationError

    from tokrag_integrations import cli
    from tokrag_integrations.langchain import FolderRetriever as LCRetriever
    from tokrag_integrations.llama_index import FolderRetriever as LIRetriever
    from tokrag_integrations.retrieval import build_retriever

    (tmp_path / "a.md").write_text("# A\n\nSome text.\n", encoding="utf-8")
    for build in (
        lambda: build_retriever(tmp_path, kind="sparse"),
        lambda: LIRetriever(tmp_path, retriever="sparse"),
    ):
        with pytest.raises(
            ValueError, match="Unknown retriever 'sparse'; use 'dense', 'bm25' or 'hybrid'"
        ):
            build()
    with pytest.raises(ValidationError, match="'dense', 'bm25' or 'hybrid'"):
        LCRetriever(paths=[str(tmp_path)], retriever="sparse")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        LCRetriever(paths=[str(tmp_path)], kind="bm25")  # the old name is refused, not ignored
    with pytest.raises(TypeError, match="kind"):
        LIRetriever(tmp_path, kind="bm25")  # type: ignore[call-arg]
    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(err):
        cli.build_parser().parse_args(["ask", "q", "--docs", str(tmp_path), "--retriever", "x"])
    assert exit_info.value.code == 2
    message = err.getvalue()  # argparse quotes the choices differently across Pythons
    assert "argument --retriever: invalid choice: 'x'" in message
    assert all(name in message for name in ("dense", "bm25", "hybrid"))
