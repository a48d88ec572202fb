"""Vocabulary masks: which token ids a rule treats specially, built once per tokenizer.

Each mask is a [V] bool tensor over the embedding rows (ids beyond the tokenizer, extra
embedding rows, are False). They depend only on the tokenizer, so the default Tok-RAG path
(:mod:`.tokrag`) builds them once per model: the retrieved punctuation left out of p_R
(:func:`punctuation_mask`), the function words kept without comparing (:func:`gate_mask`).
:func:`skip_mask` and :func:`gate_mask` follow the word lists of the authors' released code
(see :mod:`.tokrag_reference` for the file and line citations); :func:`punctuation_mask`
widens the skip list to any tokenizer.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "FILTER_WORDS",
    "SKIP_PIECES",
    "gate_mask",
    "punctuation_mask",
    "skip_mask",
    "vocab_texts",
]

#: Their ``skip_words`` (utils.py 2824-2825, Tok-RAG_for_ODQA.py 405), SentencePiece spelling
#: (``▁`` = U+2581 word boundary, ``<s>`` = BOS). The '' and ' ' entries can never equal a
#: token piece; kept for the record.
SKIP_PIECES: tuple[str, ...] = (
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "8",
    "9",
    "0",
    ".",
    "<s>",
    "'",
    " ",
    ")",
    "-",
    "]:",
    "]",
    "}:",
    ":",
    "",
    "\u2581",
    "\u2581[",
)

#: Their ``filter_words`` (utils.py 2960-2964, Tok-RAG_for_ODQA.py 400-402), compared with
#: ``tokenizer.decode`` of the RAG argmax token: the entries spelled with ``▁`` never match a
#: decoded text; kept for the record.
FILTER_WORDS: tuple[str, ...] = (
    " ",
    ")",
    "-",
    "]:",
    "]",
    "}:",
    ":",
    "\u2581",
    "\u2581[",
    "\u2581the",
    "the",
    "a",
    "an",
    "The",
    ".",
    "[",
    "'",
    "Query",
    "",
    '\u2581"',
    "<s>",
    "for",
    "in",
    "on",
    "at",
)


def _boundary_marker(tokenizer: Any) -> str:
    """The word-boundary prefix of the tokenizer's pieces: ``▁`` (SentencePiece, their
    LLaMA) or ``Ġ`` (byte-level BPE)."""
    vocab = tokenizer.get_vocab()
    n_sp = sum(1 for k in vocab if k.startswith("\u2581"))
    n_bpe = sum(1 for k in vocab if k.startswith("\u0120"))
    return "\u0120" if n_bpe > n_sp else "\u2581"


def _ids(tokenizer: Any, vocab_size: int | None) -> tuple[int, int]:
    n = len(tokenizer)
    return n, max(n, vocab_size or 0)


def skip_mask(
    tokenizer: Any, *, vocab_size: int | None = None, all_special: bool = False
) -> torch.Tensor:
    """[V] bool: the token ids whose attended positions the rule skips (step 4).

    Their test is exact membership of the token piece, ``convert_ids_to_tokens(id)``, in
    ``skip_words`` (utils.py 2824-2825, 2855; ODQA 405, 453). For another tokenizer the list
    is respelled: ``▁`` becomes the tokenizer's own boundary prefix (``Ġ`` for byte-level
    BPE) and ``<s>`` its BOS token (the literal ``<s>`` is kept too). So single digits,
    ``.``, ``'``, ``)``, ``-``, ``:``, ``]``, ``]:``, ``}:``, the bare boundary piece and the
    boundary + ``[`` piece are skipped; ``,``, ``(``, ``"``, EOS or ``▁.`` are not (their
    list does not name them). ``all_special=True`` also skips every special token (not in
    their code). ``vocab_size``: length of the mask when the embedding matrix has more rows
    than the tokenizer (the extra ids are not skipped).
    """
    n, V = _ids(tokenizer, vocab_size)
    marker = _boundary_marker(tokenizer)
    words = {w.replace("\u2581", marker) for w in SKIP_PIECES}
    if tokenizer.bos_token:
        words.add(tokenizer.bos_token)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    mask = torch.zeros(V, dtype=torch.bool)
    mask[:n] = torch.tensor([p in words for p in pieces], dtype=torch.bool)
    if all_special:
        for i in tokenizer.all_special_ids:
            if 0 <= i < V:
                mask[i] = True
    return mask


def vocab_texts(tokenizer: Any) -> list[str]:
    """Every token id of ``tokenizer`` decoded on its own (``tokenizer.decode([id])``)."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))])


def punctuation_mask(
    tokenizer: Any, *, vocab_size: int | None = None, texts: list[str] | None = None
) -> torch.Tensor:
    """[V] bool: the token ids whose decoded text holds no letter and no digit (punctuation,
    spaces, symbols): the positions ``TokRAG(pr_skip="punctuation")`` leaves out of p_R. Not
    in the authors' code: their :func:`skip_mask` list widened to every such token of any
    tokenizer, digits kept. Ids beyond the tokenizer (extra embedding rows) are not skipped.
    ``texts``: :func:`vocab_texts` of the tokenizer, when already at hand."""
    n, V = _ids(tokenizer, vocab_size)
    texts = vocab_texts(tokenizer) if texts is None else texts
    mask = torch.zeros(V, dtype=torch.bool)
    mask[:n] = torch.tensor([not any(c.isalnum() for c in t) for t in texts], dtype=torch.bool)
    return mask


def gate_mask(
    tokenizer: Any, *, vocab_size: int | None = None, texts: list[str] | None = None
) -> torch.Tensor:
    """[V] bool: RAG argmax tokens for which the rule takes RAG's token without comparing
    (step 1, utils.py 3070-3073).

    Their test is ``tokenizer.decode(token) in filter_words``. Decoding a lone LLaMA piece
    drops its leading ``▁`` (SentencePiece), so ``▁the`` decodes to ``the``; here one leading
    space of the decoded text is dropped likewise, which gives the same sets on a byte-level
    tokenizer: ``the`` / `` the``, ``a``, ``an``, ``The``, ``for``, ``in``, ``on``, ``at``,
    ``.``, ``[``, ``'``, ``:``, ``-``, ``)``, ``]``, ``]:``, ``}:``, ``Query``, the bare space,
    and the BOS token. ``texts``: :func:`vocab_texts` of the tokenizer, when already at hand.
    """
    n, V = _ids(tokenizer, vocab_size)
    words = set(FILTER_WORDS)
    if tokenizer.bos_token:
        words.add(tokenizer.bos_token)
    texts = vocab_texts(tokenizer) if texts is None else texts
    mask = torch.zeros(V, dtype=torch.bool)
    mask[:n] = torch.tensor(
        [(t[1:] if t.startswith(" ") else t) in words for t in texts], dtype=torch.bool
    )
    return mask
