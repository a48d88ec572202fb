"""Verdict words: the tokens that state an answer's polarity.

A yes/no verdict or a negation is the model's judgement *of* the retrieved text, rarely a
word copied *from* it. Tok-RAG's retrieval embedding w_IR (Eq. 15-17) is a mixture of the
embeddings of retrieved tokens, so it cannot stand for such a token, and Eq. 19 compares it
against a vector that does not contain it: the comparison is biased against RAG's verdict
whatever the passage says. ``TokRAG(verdict_gate="either")``, the default, therefore keeps
RAG's token without comparing wherever either candidate is a verdict word, the way the
authors' function-word gate keeps RAG's function words (docs/results.md, "Verdict words"):
the answer states RAG's verdict. ``verdict_gate="rag"`` gates RAG's verdict words only and
leaves a verdict word of the pure model's to Eq. 19.

The list: the two verdict words of a yes/no answer and the single-word English negators (not,
no, n't, never, nothing, none, nobody, neither, nor, cannot), plus the "'t" piece byte-level
vocabularies split from "don't", "isn't", "can't". It is fixed by grammar, not tuned.
"""

from __future__ import annotations

from typing import Any

import torch

from .vocab import _ids, vocab_texts

#: Lower-cased whole-token texts (one leading space dropped) that state polarity.
VERDICT_WORDS = frozenset(
    {
        "yes",
        "no",
        "not",
        "n't",
        "'t",
        "never",
        "nothing",
        "none",
        "nobody",
        "neither",
        "nor",
        "cannot",
    }
)


def verdict_mask(
    tokenizer: Any, *, vocab_size: int | None = None, texts: list[str] | None = None
) -> torch.Tensor:
    """[V] bool: the token ids whose decoded text (one leading space dropped, case folded) is
    one of :data:`VERDICT_WORDS`, with the contract of the sibling vocabulary masks in
    :mod:`.vocab`: ids beyond the tokenizer (extra embedding rows) are False;
    ``texts``: :func:`~.vocab.vocab_texts` of the tokenizer, when already at hand."""
    n, V = _ids(tokenizer, vocab_size)
    texts = vocab_texts(tokenizer) if texts is None else texts
    mask = torch.zeros(V, dtype=torch.bool)
    mask[:n] = torch.tensor(
        [(t[1:] if t.startswith(" ") else t).lower() in VERDICT_WORDS for t in texts],
        dtype=torch.bool,
    )
    return mask
