"""A test-only :class:`tokrag_integrations.sampling.TokenConstraint` that needs no grammar
library: digit tokens only, complete after ``n`` tokens (the engine's side of constrained
decoding tested on its own)."""

from __future__ import annotations

import torch


class Digits:
    """A test constraint: only tokens that are all digits (and EOS once ``n`` are taken);
    complete after ``n`` tokens."""

    def __init__(self, lm, n: int = 3):
        self.lm, self.n, self.taken = lm, n, []
        V = lm.model.config.vocab_size
        tok = lm.tokenizer
        cache = lm.__dict__.setdefault("_test_digit_ids", None)
        if cache is None:
            cache = [i for i in range(min(V, len(tok))) if tok.decode([i]).strip().isdigit()]
            lm.__dict__["_test_digit_ids"] = cache
        self.allowed = cache

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        ids = list(self.allowed)
        if len(self.taken) >= self.n:
            ids = list(self.lm.eos_token_ids)
        row = [0] * bitmask.shape[1]
        for t in ids:
            row[t // 32] |= 1 << (t % 32)
        bitmask[index] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in row], dtype=torch.int32)

    def accept(self, token_id: int) -> None:
        if token_id not in self.allowed:
            raise ValueError(f"token {token_id} is not allowed")
        self.taken.append(token_id)

    def is_finished(self) -> bool:
        return len(self.taken) >= self.n

    def fork(self) -> Digits:
        return Digits(self.lm, self.n)
