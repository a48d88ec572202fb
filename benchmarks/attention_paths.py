"""The ``tokrag_sdpa`` attention (``accel/sdpa.py``) against the path it replaces.

SmolLM2-135M's attention shape (9 query heads, 3 key/value heads, head size 64), one layer,
timed side by side in interleaved rounds (order alternating; the median of the per-round
ratios is printed, below 1: ``tokrag_sdpa`` is faster). Each case is a left-padded batch;
the other side is one masked ``F.scaled_dot_product_attention`` call over every key (what
``tokrag_sdpa`` does for one query per row) or, for several positions, transformers' SDPA
function (which repeats the key/value heads). The cases: a fused pure + RAG step of one,
two and eight queries (2, 4 and 16 one-query rows, 60 and 850 keys) and a padded prefill
of 8 short prompts (8 and 40 positions).

    OMP_NUM_THREADS=2 python benchmarks/attention_paths.py --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

H, HKV, HD = 9, 3, 64


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = H // HKV
    layer_idx = None


def _batch(lengths: list[int], q: int = 1) -> tuple[torch.Tensor, ...]:
    """Queries [B, H, q, hd], keys/values [B, Hkv, T, hd], a left-padding mask [B, 1, q, T]."""
    b, t = len(lengths), max(lengths)
    query = torch.randn(b, H, q, HD)
    key, value = torch.randn(b, HKV, t, HD), torch.randn(b, HKV, t, HD)
    mask = torch.zeros(b, 1, q, t, dtype=torch.bool)
    for r, n in enumerate(lengths):
        mask[r, :, :, t - n :] = True
        if q > 1:  # causal within the row's own positions
            mask[r, 0, :, t - n :] &= torch.ones(q, n, dtype=torch.bool).tril(n - q)
    return query, key, value, mask


def _ratio(fast: Callable[[], object], slow: Callable[[], object], rounds: int, reps: int) -> float:
    def t(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return time.perf_counter() - t0

    fast(), slow()
    ratios = []
    for r in range(rounds):
        a, b = (t(fast), t(slow)) if r % 2 == 0 else reversed((t(slow), t(fast)))
        ratios.append(a / b)
    return statistics.median(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tokrag_integrations.accel.sdpa import few_query_attention

    mod = _Attn()
    scale = HD**-0.5

    def tokrag_sdpa(query, key, value, mask):
        return lambda: few_query_attention(mod, query, key, value, mask, scaling=scale)

    def one_masked_call(query, key, value, mask):
        return lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)

    def transformers_sdpa(query, key, value, mask):
        return lambda: sdpa_attention_forward(mod, query, key, value, mask, scaling=scale)

    cases = {
        "2 rows (60 / 850 keys)": (_batch([60, 850]), one_masked_call),
        "4 rows (60, 60, 850, 850 keys)": (_batch([60, 60, 850, 850]), one_masked_call),
        "16 rows (8 x 60, 8 x 850 keys)": (_batch([60] * 8 + [850] * 8), one_masked_call),
        "8 rows x 8 positions": (_batch([8] * 4 + [4] * 4, q=8), transformers_sdpa),
        "8 rows x 40 positions": (_batch([40] * 4 + [20] * 4, q=40), transformers_sdpa),
    }
    with torch.inference_mode():
        for name, (tensors, other) in cases.items():
            print(f"{name}: {_ratio(tokrag_sdpa(*tensors), other(*tensors), args.rounds, args.reps):.2f}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
