"""Batches, references and comparisons shared by the advantage estimators' tests (GTPO-token, GRPO-S, GTPO-traj and
their compiled kernels).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from gtpo.algorithms.group_ops import group_ids
from gtpo.algorithms.gtpo_token import GTPOParams


def response_mask(lengths, width):
    """``[B, width]`` mask of 1s on the first ``lengths[b]`` positions of each row."""
    return (torch.arange(width)[None, :] < torch.as_tensor(lengths)[:, None]).long()


def token_batch(lengths, rewards, groups, L=None, seed=0, h_lo=0.2, h_hi=3.0, token_entropy=None):
    """Right-padded batch: entropy U[h_lo, h_hi] (or ``token_entropy`` everywhere) on valid tokens, garbage (NaN) on
    padding; returns ``(entropy, mask, rewards, group_ids, n_groups)``."""
    g = torch.Generator().manual_seed(seed)
    L = L or max(max(lengths), 1)
    b = len(lengths)
    mask = torch.zeros(b, L)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    if token_entropy is None:
        ent = h_lo + (h_hi - h_lo) * torch.rand(b, L, generator=g)
    else:
        ent = torch.full((b, L), token_entropy)
    ent = torch.where(mask.bool(), ent, torch.full_like(ent, float("nan")))
    gid, ng = group_ids(np.asarray(groups, dtype=object))
    return ent, mask, torch.tensor(rewards, dtype=torch.float32), gid, ng


def random_token_batch(seed, n_groups=5, max_g=6, L=9, reward_kind="pm1", allow_empty=True, allow_single=True):
    """Random groups (sizes 1..max_g unless not ``allow_single``, empty responses unless not ``allow_empty``),
    rewards +-1 (``pm1``) or 1/0, rows shuffled: a :func:`token_batch`."""
    rng = random.Random(seed)
    lengths, rewards, groups = [], [], []
    for k in range(n_groups):
        size = rng.randint(1 if allow_single else 2, max_g)
        for _ in range(size):
            lo = 0 if (allow_empty and rng.random() < 0.1) else 1
            lengths.append(rng.randint(lo, L) if lo == 0 else rng.randint(1, L))
            ok = rng.random() < 0.5
            rewards.append((1.0 if ok else -1.0) if reward_kind == "pm1" else (1.0 if ok else 0.0))
            groups.append(f"uid-{k}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    lengths = [lengths[i] for i in order]
    rewards = [rewards[i] for i in order]
    groups = [groups[i] for i in order]
    return token_batch(lengths, rewards, groups, L=L, seed=seed)


def gtpo_loop_reference(ent, mask, rewards, groups, p: GTPOParams, offset=None):
    """Obviously-correct GTPO: Python loops over groups, positions, sets and tokens."""
    B, L = mask.shape
    H = [[float(ent[b, t]) if mask[b, t] else 0.0 for t in range(L)] for b in range(B)]
    H = [[max(x, 0.0) for x in row] for row in H]
    M = [[bool(mask[b, t]) for t in range(L)] for b in range(B)]
    r = [float(x) for x in rewards]
    correct = [x > p.reward_threshold for x in r]
    base = []
    for b in range(B):
        v = r[b] if correct[b] else (r[b] if p.negative_base == "reward" else -1.0)
        base.append(v + (float(offset[b]) if offset is not None else 0.0))
    labels = [int(x) for x in groups]
    shaped = [[0.0] * L for _ in range(B)]
    weight_scopes = sorted(set(labels)) if p.weight_scope == "group" else [None]
    for g in weight_scopes:
        rows = [b for b in range(B) if g is None or labels[b] == g]
        for t in range(L):
            P = [b for b in rows if correct[b] and M[b][t]]
            N = [b for b in rows if not correct[b] and M[b][t]]
            sh = sum(H[b][t] for b in P)
            for b in P:
                shaped[b][t] = p.alpha1 * base[b] + p.alpha2 * H[b][t] / (sh + p.eps) * len(P)
            si = sum(1.0 / (H[b][t] + p.eps) for b in N)
            for b in N:
                shaped[b][t] = p.alpha1 * base[b] - p.alpha2 * (1.0 / (H[b][t] + p.eps)) / (si + p.eps) * len(N)
    # whitening sets
    # whitening sets: (tokens whose values enter the statistics, value of each, tokens that take the result)
    sets = []
    scopes = sorted(set(labels)) if p.norm_scope == "group" else [None]
    for g in scopes:
        in_scope = [b for b in range(B) if g is None or labels[b] == g]
        toks = [(b, t) for b in in_scope for t in range(L) if M[b][t]]
        pos = [(b, t) for b, t in toks if correct[b]]
        neg = [(b, t) for b, t in toks if not correct[b]]
        if p.norm_mode == "split":
            sets += [(pos, [shaped[b][t] for b, t in pos], pos), (neg, [shaped[b][t] for b, t in neg], neg)]
        elif p.norm_mode == "zero_fill":
            # Eq. 3 / 5: r~+ is 0 on incorrect tokens and r~- on correct ones; each field over all tokens
            sets.append((toks, [shaped[b][t] if correct[b] else 0.0 for b, t in toks], pos))
            sets.append((toks, [0.0 if correct[b] else shaped[b][t] for b, t in toks], neg))
        else:
            sets.append((toks, [shaped[b][t] for b, t in toks], toks))
    adv = [[0.0] * L for _ in range(B)]
    for _members, vals, takers in sets:
        if len(vals) <= 1:
            continue
        mu = sum(vals) / len(vals)
        denom = len(vals) - 1 if p.std == "unbiased" else len(vals)
        sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / denom)
        if sd <= p.zero_var_rtol * sum(abs(v) for v in vals) / len(vals):
            continue
        for b, t in takers:
            adv[b][t] = (shaped[b][t] - mu) / (sd + p.eps)
    return torch.tensor(shaped, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64)


def random_batch(seed: int, groups: int = 7, length: int = 23, holes: bool = False):
    """A kernel test's batch: groups of 1..6 rows in any order, masks with holes if asked, NaN on padding, GROP-like
    offsets; returns ``(entropy, mask, rewards, group_ids, n_groups, responses, offset)``."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 7, (groups,), generator=gen)
    gid = torch.repeat_interleave(torch.arange(groups), sizes)
    gid = gid[torch.randperm(gid.numel(), generator=gen)]  # rows in any order
    rows = gid.numel()
    lengths = torch.randint(0, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    if holes:  # zeros inside responses (multi-turn tool tokens)
        mask = mask * (torch.rand(rows, length, generator=gen) > 0.15)
    entropy = torch.rand(rows, length, generator=gen) * 4 + 0.05
    entropy = torch.where(mask.bool(), entropy, torch.full_like(entropy, float("nan")))  # padding is never read
    rewards = torch.where(torch.rand(rows, generator=gen) < 0.5, 1.0, -1.0)
    responses = torch.randint(0, 3, (rows, length), generator=gen)
    offset = -0.5 * torch.rand(rows, generator=gen)  # GROP-like: bases that vary inside each polarity
    return entropy, mask, rewards, gid, groups, responses, offset


def assert_same(kernel, definition, diag_keys=None):
    """A kernel's ``(advantages, diagnostics)`` equal its definition's (the compile time aside)."""
    (adv, diag), (ref, ref_diag) = kernel, definition
    torch.testing.assert_close(adv, ref, rtol=1e-5, atol=1e-6)
    diag, ref_diag = ({k: v for k, v in d.items() if k != "kernel_compile_s"} for d in (diag, ref_diag))
    assert set(diag) == set(ref_diag)
    for key in diag_keys or ref_diag:
        assert diag[key] == pytest.approx(ref_diag[key], rel=1e-5, abs=1e-7), key


def random_traj_batch(seed):
    """GTPO-traj's batch: 2..6 groups of 1..6 rows, 0/1 scores, binary token ids; returns
    ``(scores, mask, ids, entropy, group_ids, n_groups)``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sizes = [rng.randint(1, 6) for _ in range(rng.randint(2, 6))]
    gid = torch.tensor([g for g, s in enumerate(sizes) for _ in range(s)])
    gid = gid[torch.randperm(len(gid), generator=gen)]
    bsz, width = len(gid), rng.randint(3, 12)
    lengths = torch.randint(0, width + 1, (bsz,), generator=gen)
    mask = response_mask(lengths, width)
    if seed % 3 == 2:
        mask = mask * (torch.rand(bsz, width, generator=gen) > 0.2).long()
    ids = torch.randint(0, 2, (bsz, width), generator=gen)
    ent = torch.where(mask.bool(), torch.rand(bsz, width, generator=gen) * 1.2, float("nan"))
    scores = torch.randint(0, 2, (bsz,), generator=gen).float()
    return scores, mask, ids, ent, gid, len(sizes)
