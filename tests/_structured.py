"""Helpers of the structured-output tests: the packaged tokenizer without the model, and a
constraint stepped through text."""

from __future__ import annotations

import json
import re
from importlib import resources


class TokenizerOnly:
    """What constraint_for reads of a loaded model: its tokenizer, vocabulary size, EOS ids
    and the per-model memo (a real LoadedModel without the weights)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = 49152
        self.eos_token_ids = [int(tokenizer.eos_token_id)]
        self._memo: dict = {}
        self.builds = 0

    def memo(self, key, build):
        if key not in self._memo:
            self.builds += 1
            self._memo[key] = build()
        return self._memo[key]


def packaged_tokenizer():
    """The packaged SmolLM2's tokenizer: from the converted model's folder, or read from the
    GGUF file without its weights."""
    from transformers import AutoTokenizer

    from tokrag_integrations.config import cache_dir
    from tokrag_integrations.models import files

    folder = cache_dir() / "models" / "smollm2-135m-instruct"
    if files._converted(folder):
        return AutoTokenizer.from_pretrained(str(folder))
    gguf = files._smollm2_folder() / files._SMOLLM2_GGUF  # the tokenizer only, read from the GGUF
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def ids_of(lm, text):
    return lm.tokenizer(text, add_special_tokens=False)["input_ids"]


def walk(constraint, lm, text):
    """Accept ``text``'s tokens one by one, each checked against the mask first."""
    for token in ids_of(lm, text):
        assert constraint.allowed(token), f"{lm.tokenizer.decode([token])!r} refused in {text!r}"
        constraint.accept(token)


def sample_questions(n: int) -> list[tuple[str, list[str]]]:
    """The first ``n`` packaged sample questions, each with the paragraph of its source
    document that holds the answer as the one passage."""
    root = resources.files("tokrag_integrations")
    out = []
    for q in json.loads((root / "sample_questions.json").read_text())[:n]:
        text = (root / "sample_docs" / q["source"]).read_text()
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if q["answer"] in p]
        out.append((q["question"], paragraphs[:1] or [text[:800]]))
    return out
