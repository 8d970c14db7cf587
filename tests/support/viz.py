"""A token dump with hand-picked values (gtpo/viz/tokens.py's JSONL), for the heatmap tests and what a browser shows
of it: five responses in two prompt groups, tokenized one byte per token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gtpo.viz.tokens import token_records, write_token_dump


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255): multi-byte characters split across tokens, as in byte-level BPE."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=False):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


# Each response is a list of token strings (ASCII, so one byte = one token) with hand-picked per-token values.
RESPONSES = [
    # uid, token texts, advantages, entropies, score
    (
        "p0",
        ["x", "<", "b", ">", "&", "\n", "y"],
        [0.0, 0.5, 1.0, 2.0, 0.0, 0.25, 0.0],
        [0.1, 0.2, 0.4, 0.8, 1.6, 0.02, 3.2],
        1.0,
    ),
    ("p0", ["a", " ", "b", "c"], [-0.5, -1.0, -2.5, 0.0], [0.01, 0.5, 1.0, 1.5], -1.0),
    ("p1", ["q", "\t", "r"], [-0.25, 0.0, 0.75], [2.0, 1.0, 0.5], -1.0),
    ("p0", ["z", "z"], [1.5, 1.5], [0.3, 0.3], 1.0),
    ("p1", ["'", '"', "k"], [0.1, -0.1, 0.0], [0.05, 0.15, 0.25], 1.0),
]


def padded_responses(pad_len: int = 10):
    """Right-padded [B, L] tensors; padding holds junk (id 0, advantage 99, entropy 99) that must never show."""
    b = len(RESPONSES)
    ids = np.zeros((b, pad_len), dtype=np.int64)
    mask = np.zeros((b, pad_len), dtype=np.int64)
    adv = np.full((b, pad_len), 99.0)
    ent = np.full((b, pad_len), 99.0)
    token_scores = np.zeros((b, pad_len))
    for r, (_, toks, a, h, score) in enumerate(RESPONSES):
        n = len(toks)
        ids[r, :n] = [ord(t) for t in toks]
        mask[r, :n] = 1
        adv[r, :n] = a
        ent[r, :n] = h
        token_scores[r, n - 1] = score  # verl puts the sequence reward on the last response token
    token_scores[:, -1] += 5.0 * (1 - mask[:, -1])  # junk on padding, excluded by the mask
    uids = np.array([u for u, *_ in RESPONSES], dtype=object)
    return ids, mask, adv, ent, token_scores, uids


def padded_records(step: int, **extra) -> list[dict]:
    """:data:`RESPONSES` through :func:`token_records` (ids, mask, advantages, entropy, scores), plus ``extra``."""
    ids, mask, adv, ent, scores, uids = padded_responses()
    return token_records(
        step=step,
        uids=uids,
        responses=ids,
        response_mask=mask,
        tokenizer=ByteTokenizer(),
        advantages=adv,
        entropy=ent,
        scores=scores,
        **extra,
    )


def write_dump(folder: Path) -> Path:
    """:data:`RESPONSES` as the token dump of step 7, ``folder/rollouts/tokens_7.jsonl``."""
    uids = [u for u, *_ in RESPONSES]
    recs = padded_records(
        7, prompts=[f"prompt of {u} <x>" for u in uids], keys=[f"{u}_0_{i}" for i, u in enumerate(uids)]
    )
    return write_token_dump(recs, folder / "rollouts" / "tokens_7.jsonl")
