"""Vocabulary masks: which token ids a rule treats specially, built once per tokenizer.

Each mask is a [V] bool tensor over the embedding rows (ids beyond the tokenizer, extra
embedding rows, are False; ``vocab_size``: the number of rows). :func:`skip_mask` and
:func:`gate_mask` follow the word lists of the authors' released code (citations in
:mod:`.tokrag_authors`); :func:`punctuation_mask` widens the skip list to any tokenizer;
:func:`verdict_mask` holds the words that state an answer's polarity. ``texts``:
:func:`vocab_texts` of the tokenizer, when already at hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

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


#: Lower-cased whole-token texts (one leading space dropped) that state polarity: the two
#: verdicts of a yes/no answer, the single-word English negators, and the "'t" piece
#: byte-level vocabularies split from "don't", "isn't", "can't". Fixed by grammar, not tuned.
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


def _boundary_marker(tokenizer: Any) -> str:
    """The word-boundary prefix of the tokenizer's pieces: ``▁`` (SentencePiece, their
    LLaMA) or ``Ġ`` (byte-level BPE)."""
    vocab = tokenizer.get_vocab()
    n_sp = sum(1 for k in vocab if k.startswith("\u2581"))
    n_bpe = sum(1 for k in vocab if k.startswith("\u0120"))
    return "\u0120" if n_bpe > n_sp else "\u2581"


def _mask(
    tokenizer: Any, vocab_size: int | None, strings: list[str], keep: Callable[[str], bool]
) -> torch.Tensor:
    """[V] bool: True at the ids of the tokenizer whose string (``strings[id]``) ``keep``
    accepts."""
    n = len(tokenizer)
    mask = torch.zeros(max(n, vocab_size or 0), dtype=torch.bool)
    mask[:n] = torch.tensor([keep(x) for x in strings], dtype=torch.bool)
    return mask


def _bare(text: str) -> str:
    """``text`` with one leading space dropped (decoding a lone LLaMA piece drops its ``▁``)."""
    return text[1:] if text.startswith(" ") else text


def skip_mask(
    tokenizer: Any, *, vocab_size: int | None = None, all_special: bool = False
) -> torch.Tensor:
    """[V] bool: the token ids whose attended positions the rule skips (step 4): the token
    piece, ``convert_ids_to_tokens(id)``, is one of ``skip_words`` (utils.py 2824-2825, 2855;
    ODQA 405, 453), respelled for the tokenizer (``▁`` becomes its boundary prefix, ``Ġ`` for
    byte-level BPE; its BOS token added). ``,``, ``(``, ``"``, EOS or ``▁.`` are not skipped
    (their list does not name them). ``all_special=True`` also skips every special token (not
    in their code)."""
    marker = _boundary_marker(tokenizer)
    words = {w.replace("\u2581", marker) for w in SKIP_PIECES}
    if tokenizer.bos_token:
        words.add(tokenizer.bos_token)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    mask = _mask(tokenizer, vocab_size, pieces, words.__contains__)
    if all_special:
        for i in tokenizer.all_special_ids:
            if 0 <= i < mask.numel():
                mask[i] = True
    return mask


def vocab_texts(tokenizer: Any) -> list[str]:
    """Every token id of ``tokenizer`` decoded on its own (``tokenizer.decode([id])``)."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))])


def punctuation_mask(
    tokenizer: Any, *, vocab_size: int | None = None, texts: list[str] | None = None
) -> torch.Tensor:
    """[V] bool: the token ids whose decoded text holds no letter and no digit (punctuation,
    spaces, symbols): the positions ``TokRAG(pr_skip="punctuation")`` leaves out of p_R."""
    texts = vocab_texts(tokenizer) if texts is None else texts
    return _mask(tokenizer, vocab_size, texts, lambda t: not any(c.isalnum() for c in t))


def gate_mask(
    tokenizer: Any, *, vocab_size: int | None = None, texts: list[str] | None = None
) -> torch.Tensor:
    """[V] bool: RAG argmax tokens for which the rule takes RAG's token without comparing
    (step 1, utils.py 3070-3073): ``tokenizer.decode(token) in filter_words``, the text
    :func:`_bare`, so a byte-level tokenizer gets the same sets; the BOS token added."""
    words = set(FILTER_WORDS)
    if tokenizer.bos_token:
        words.add(tokenizer.bos_token)
    texts = vocab_texts(tokenizer) if texts is None else texts
    return _mask(tokenizer, vocab_size, texts, lambda t: _bare(t) in words)


def verdict_mask(
    tokenizer: Any, *, vocab_size: int | None = None, texts: list[str] | None = None
) -> torch.Tensor:
    """[V] bool: the token ids whose decoded text, :func:`_bare` and case folded, is one of
    :data:`VERDICT_WORDS` (``TokRAG``'s ``verdict_gate``: w_IR, a mixture of retrieved
    tokens, cannot stand for a verdict, which is inferred from a passage, not copied)."""
    texts = vocab_texts(tokenizer) if texts is None else texts
    return _mask(tokenizer, vocab_size, texts, lambda t: _bare(t).lower() in VERDICT_WORDS)
