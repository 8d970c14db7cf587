"""GRPO-S (arXiv 2508.04349, docs/ALGORITHMS.md §4): claims A2-T1..T4 of §8.2, worked values, edge cases, loss math.

Run: cd /work/main && .venv/bin/pytest -q tests/test_grpo_s.py
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from gtpo.algorithms.grpo_s import (
    GRPOSParams,
    grpo_s_advantages,
    grpo_s_loss_matrix,
    grpo_s_sequence_rewards,
    sequence_entropy,
    sequence_ratio,
)
from tests.support.estimators import token_batch


def _joint(**kwargs) -> GRPOSParams:
    """The signed-reward (joint) normalisation, the recipe's reading before paper A's §2.3 was read."""
    return GRPOSParams(**{"norm_mode": "joint", **kwargs})


def _random_groups(seed, n_groups=6, min_g=1, max_g=7, L=8, reward_kind="pm1", empty_p=0.1):
    rng = random.Random(seed)
    lengths, rewards, groups = [], [], []
    for k in range(n_groups):
        for _ in range(rng.randint(min_g, max_g)):
            lengths.append(0 if rng.random() < empty_p else rng.randint(1, L))
            ok = rng.random() < 0.5
            rewards.append((1.0 if ok else -1.0) if reward_kind == "pm1" else float(ok))
            groups.append(f"u{k}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    return [lengths[i] for i in order], [rewards[i] for i in order], [groups[i] for i in order]


def _tlr(lengths, r, L):
    """verl-style token-level rewards: the score on the last valid token."""
    t = torch.zeros(len(lengths), L)
    for i, n in enumerate(lengths):
        if n:
            t[i, n - 1] = r[i]
    return t


def _loop_reference(ent, mask, rewards, groups, p: GRPOSParams, offset=None):
    B, L = mask.shape
    hbar, nonempty = [], []
    for b in range(B):
        vals = [max(float(ent[b, t]), 0.0) for t in range(L) if mask[b, t]]
        nonempty.append(len(vals) > 0)
        hbar.append(sum(vals) / len(vals) if vals else 0.0)
    r = [float(x) for x in rewards]
    correct = [x > p.reward_threshold for x in r]
    labels = [int(x) for x in groups]
    shaped = [0.0] * B
    adv = [0.0] * B
    for g in sorted(set(labels)):
        rows = [b for b in range(B) if labels[b] == g and nonempty[b]]
        P = [b for b in rows if correct[b]]
        N = [b for b in rows if not correct[b]]
        sp = sum(hbar[b] for b in P)
        si = sum(1.0 / (hbar[b] + p.eps) for b in N)
        for b in rows:
            base = r[b] if correct[b] else (r[b] if p.negative_base == "reward" else -1.0)
            base += float(offset[b]) if offset is not None else 0.0
            if correct[b]:
                shaped[b] = p.beta1 * base + p.beta2 * hbar[b] / (sp + p.eps) * len(P)
            else:
                shaped[b] = p.beta1 * base - p.beta2 * (1.0 / (hbar[b] + p.eps)) / (si + p.eps) * len(N)
        if len(rows) < 2:
            continue
        if p.norm_mode == "zero_fill":
            # Eq. 9: r^+ is 0 on the incorrect responses, r^- on the correct ones; each field over the G responses
            fields = [
                ([shaped[b] if correct[b] else 0.0 for b in rows], P),
                ([0.0 if correct[b] else shaped[b] for b in rows], N),
            ]
        else:
            fields = [([shaped[b] for b in rows], rows)]
        for vals, takers in fields:
            mu = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - (1 if p.std == "unbiased" else 0)))
            if sd <= p.zero_var_rtol * sum(abs(v) for v in vals) / len(vals):
                continue
            for b in takers:
                adv[b] = (shaped[b] - mu) / (sd + p.eps)
    return torch.tensor(shaped, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------------------
# worked example and Hbar


def test_worked_example_by_hand():
    # Hbar: correct 3 and 1, incorrect 2 and 2 (constant token entropy per row, different lengths)
    ent = torch.tensor([[3.0, 3.0, 3.0], [1.0, 1.0, 0.0], [2.0, 2.0, 2.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    r = torch.tensor([1.0, 1.0, -1.0, -1.0])
    gid = torch.zeros(4, dtype=torch.long)
    hbar = sequence_entropy(ent, mask)
    torch.testing.assert_close(hbar, torch.tensor([3.0, 1.0, 2.0, 2.0], dtype=torch.float64))
    shaped = grpo_s_sequence_rewards(hbar, r, gid, 1)
    # 1 + 0.1 * 3/4 * 2 = 1.15; 1 + 0.1 * 1/4 * 2 = 1.05; -1 - 0.1 * (1/2)/(1) * 2 = -1.1
    torch.testing.assert_close(shaped, torch.tensor([1.15, 1.05, -1.1, -1.1], dtype=torch.float64), atol=1e-6, rtol=0)
    adv, _ = grpo_s_advantages(ent, mask, r, gid, 1, _joint())
    vals = [1.15, 1.05, -1.1, -1.1]
    sd = math.sqrt(sum(v * v for v in vals) / 3)  # mean is 0
    expected = torch.tensor([v / (sd + 1e-6) for v in vals])[:, None] * mask
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_zero_fill_worked_example_by_hand():
    """Eq. 9 with r^- = 0 on correct and r^+ = 0 on incorrect responses, each field over the group's G = 4."""
    ent = torch.tensor([[3.0, 3, 3], [1.0, 1, 0], [2.0, 2, 2], [2.0, 0, 0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    r, gid = torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.zeros(4, dtype=torch.long)
    adv, _ = grpo_s_advantages(ent, mask, r, gid, 1)
    assert GRPOSParams().norm_mode == "zero_fill"
    # fields: r^+ = [1.15, 1.05, 0, 0] (mean 0.55), r^- = [0, 0, -1.1, -1.1] (mean -0.55); unbiased std over G = 4
    sd_pos = math.sqrt((0.6**2 + 0.5**2 + 2 * 0.55**2) / 3)
    sd_neg = math.sqrt(4 * 0.55**2 / 3)
    expected = torch.tensor(
        [0.6 / (sd_pos + 1e-6), 0.5 / (sd_pos + 1e-6), -0.55 / (sd_neg + 1e-6), -0.55 / (sd_neg + 1e-6)]
    )
    torch.testing.assert_close(adv, expected[:, None] * mask, atol=1e-5, rtol=0)
    joint, _ = grpo_s_advantages(ent, mask, r, gid, 1, _joint())
    assert (joint - adv).abs().max() > 0.01  # the two modes differ once the entropy term varies


def test_sequence_entropy_is_masked_mean_and_ignores_padding():
    ent = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), -7.0], [float("nan")] * 3])
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(sequence_entropy(ent, mask), torch.tensor([1.5, 4.0, 0.0], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------------------
# A2-T1 conservation


@pytest.mark.parametrize("seed", [0, 1])
def test_a2_t1_conservation(seed):
    lengths, rewards, groups = _random_groups(seed, empty_p=0.0)
    ent, mask, r, gid, ng = token_batch(lengths, rewards, groups, seed=seed)
    hbar = sequence_entropy(ent, mask)
    correct = r > 0
    n = torch.zeros(ng, dtype=torch.float64).index_add_(0, gid, correct.double())
    m = torch.zeros(ng, dtype=torch.float64).index_add_(0, gid, (~correct).double())
    for b1, b2 in [(0.9, 0.1), (1.0, 0.1), (0.3, 0.7)]:
        shaped = grpo_s_sequence_rewards(hbar, r, gid, ng, _joint(beta1=b1, beta2=b2))
        s_pos = torch.zeros(ng, dtype=torch.float64).index_add_(0, gid, torch.where(correct, shaped, 0.0))
        s_neg = torch.zeros(ng, dtype=torch.float64).index_add_(0, gid, torch.where(~correct, shaped, 0.0))
        torch.testing.assert_close(s_pos, n * (b1 + b2), atol=1e-5, rtol=0)
        torch.testing.assert_close(s_neg, -m * (b1 + b2), atol=1e-5, rtol=0)
        if abs(b1 + b2 - 1.0) > 1e-9:  # negative control: the sum is not n when beta1 + beta2 != 1
            assert (s_pos - n)[n > 0].abs().min() > 0.05


# ---------------------------------------------------------------------------------------------------------------------
# A2-T2 identical to verl GRPO for uniform Hbar or beta2 = 0


@pytest.mark.parametrize("reward_kind", ["pm1", "01"])
@pytest.mark.parametrize("case", ["uniform", "beta2_zero"])
@pytest.mark.parametrize("norm_mode", ["joint", "zero_fill"])
def test_a2_t2_identical_to_verl_grpo(reward_kind, case, norm_mode):
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    lengths, rewards, groups = _random_groups(3, min_g=2, reward_kind=reward_kind, empty_p=0.0)
    ent, mask, r, gid, ng = token_batch(lengths, rewards, groups, token_entropy=0.8 if case == "uniform" else None)
    p = GRPOSParams(beta2=0.0 if case == "beta2_zero" else 0.1, norm_mode=norm_mode)
    adv, _ = grpo_s_advantages(ent, mask, r, gid, ng, p)
    L = mask.shape[1]
    expected, _ = compute_grpo_outcome_advantage(_tlr(lengths, r, L), mask, np.asarray(groups, dtype=object))
    torch.testing.assert_close(adv, expected, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# A2-T3 monotonicity and sign


def test_a2_t3_monotonicity():
    hbar = torch.tensor([0.5, 1.0, 2.0, 0.2, 0.9, 3.0], dtype=torch.float64)
    r = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    shaped = grpo_s_sequence_rewards(hbar, r, torch.zeros(6, dtype=torch.long), 1)
    assert shaped[0] < shaped[1] < shaped[2]
    assert shaped[3] < shaped[4] < shaped[5]


@pytest.mark.parametrize("seed", range(4))
def test_a2_t3_sign_with_small_beta2(seed):
    # with beta2 = 0.1 the correct side stays above the group mean while n < 20 m (and vice versa): G <= 7 here
    lengths, rewards, groups = _random_groups(seed, min_g=2, empty_p=0.0)
    ent, mask, r, gid, ng = token_batch(lengths, rewards, groups, seed=seed)
    adv, _ = grpo_s_advantages(ent, mask, r, gid, ng)
    a = adv[:, 0]
    correct = r > 0
    n = torch.zeros(ng).index_add_(0, gid, correct.float())[gid]
    size = torch.zeros(ng).index_add_(0, gid, torch.ones_like(r))[gid]
    mixed = (n > 0) & (n < size)
    assert bool((a[mixed & correct] > 0).all()) and bool((a[mixed & ~correct] < 0).all())


def test_a2_t3_sign_can_flip_with_large_beta2():
    ent = torch.tensor([[0.001], [10.0], [1.0]])
    r = torch.tensor([1.0, 1.0, -1.0])
    adv, _ = grpo_s_advantages(ent, torch.ones(3, 1), r, torch.zeros(3, dtype=torch.long), 1, _joint(beta2=5.0))
    assert adv[0, 0] < 0  # a correct response below its group mean: the condition of A2-T3 matters


# ---------------------------------------------------------------------------------------------------------------------
# loop reference


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm_mode", ["joint", "zero_fill"])
def test_vectorised_matches_loop_reference(seed, norm_mode):
    lengths, rewards, groups = _random_groups(200 + seed, reward_kind="01" if seed % 2 else "pm1")
    ent, mask, r, gid, ng = token_batch(lengths, rewards, groups, seed=seed)
    std = "population" if seed % 3 == 0 else "unbiased"
    p = GRPOSParams(beta2=0.1 + 0.3 * seed, std=std, norm_mode=norm_mode)
    offset = -0.5 * torch.rand(len(r), generator=torch.Generator().manual_seed(seed)) if seed % 2 else None
    shaped_ref, adv_ref = _loop_reference(ent, mask, r, gid, p, offset)
    nonempty = mask.bool().any(-1)
    shaped = grpo_s_sequence_rewards(sequence_entropy(ent, mask), r, gid, ng, p, nonempty, offset)
    torch.testing.assert_close(shaped, shaped_ref, atol=1e-9, rtol=1e-9)
    adv, _ = grpo_s_advantages(ent, mask, r, gid, ng, p, reward_offset=offset)
    torch.testing.assert_close(adv.double(), adv_ref[:, None] * mask.double(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# edge cases


def test_all_correct_group_entropy_rank_and_uniform_zero():
    ent, mask, r, gid, ng = token_batch([3, 4, 2], [1, 1, 1], ["a"] * 3, seed=1)
    adv, diag = grpo_s_advantages(ent, mask, r, gid, ng)
    hbar = sequence_entropy(ent, mask)
    assert torch.equal(torch.argsort(adv[:, 0]), torch.argsort(hbar))
    assert diag["frac_groups_all_correct"] == 1.0
    ent_u, mask_u, r_u, gid_u, ng_u = token_batch([3, 4, 2], [1, 1, 1], ["a"] * 3, token_entropy=0.7)
    adv_u, _ = grpo_s_advantages(ent_u, mask_u, r_u, gid_u, ng_u)
    assert torch.count_nonzero(adv_u) == 0


def test_single_response_group_is_zero():
    ent, mask, r, gid, ng = token_batch([3, 4, 2], [1, 1, -1], ["solo", "g", "g"])
    adv, _ = grpo_s_advantages(ent, mask, r, gid, ng)
    assert torch.count_nonzero(adv[0]) == 0 and torch.count_nonzero(adv[1:]) > 0


def test_empty_rows_take_no_part():
    ent, mask, r, gid, ng = token_batch([3, 4, 2, 3], [1, 1, -1, -1], ["g"] * 4, seed=2)
    e2 = torch.cat([ent, torch.full((2, 4), float("nan"))])
    m2 = torch.cat([mask, torch.zeros(2, 4)])
    r2 = torch.cat([r, torch.tensor([1.0, -1.0])])
    g2 = torch.cat([gid, torch.zeros(2, dtype=torch.long)])
    a, _ = grpo_s_advantages(ent, mask, r, gid, ng)
    a2, _ = grpo_s_advantages(e2, m2, r2, g2, ng)
    assert torch.equal(a2[:4], a) and torch.count_nonzero(a2[4:]) == 0


def test_zero_entropy_sequences():
    ent = torch.tensor([[0.0, 0.0], [1.0, 2.0], [0.0, 0.0], [0.5, 0.5]])
    r = torch.tensor([1.0, 1.0, -1.0, -1.0])
    gid = torch.zeros(4, dtype=torch.long)
    shaped = grpo_s_sequence_rewards(sequence_entropy(ent, torch.ones(4, 2)), r, gid, 1)
    # correct with Hbar = 0: weight 0 -> beta1 * r; incorrect with Hbar = 0 takes almost all the inverse weight
    assert abs(float(shaped[0]) - 1.0) < 1e-12
    assert abs(float(shaped[1]) - 1.2) < 1e-6
    assert abs(float(shaped[2]) + 1.2) < 1e-5 and abs(float(shaped[3]) + 1.0) < 1e-5


def test_padding_gets_nothing_and_diag_keys():
    lengths, rewards, groups = _random_groups(5)
    ent, mask, r, gid, ng = token_batch(lengths, rewards, groups)
    adv, diag = grpo_s_advantages(ent, mask, r, gid, ng)
    assert torch.count_nonzero(adv[~mask.bool()]) == 0
    assert set(diag) == {
        "seq_weight_pos_mean", "seq_weight_pos_max", "seq_weight_neg_mean", "seq_weight_neg_max",
        "adv_correct_mean", "adv_incorrect_mean", "adv_abs_mean", "frac_seq_adv_pos", "frac_seq_adv_neg",
        "conservation_err", "frac_groups_all_correct", "frac_groups_all_wrong", "seq_entropy_correct_mean",
        "seq_entropy_incorrect_mean",
    }  # fmt: skip
    assert all(isinstance(v, float) and math.isfinite(v) for v in diag.values())
    assert diag["conservation_err"] < 1e-5
    assert abs(diag["seq_weight_pos_mean"] - 1.0) < 1e-5


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"beta1": -1.0}, "beta1"),
        ({"beta2": -0.1}, "beta2"),
        ({"beta1": 0.0, "beta2": 0.0}, "beta1"),
        ({"eps": -1e-6}, "eps"),
        ({"reward_threshold": float("nan")}, "reward_threshold"),
        ({"std": "sample"}, "std"),
        ({"negative_base": "one"}, "negative_base"),
        ({"zero_var_rtol": 2.0}, "zero_var_rtol"),
        ({"neg_entropy_tol": float("inf")}, "neg_entropy_tol"),
    ],
)
def test_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        _joint(**kwargs)


@pytest.mark.parametrize(
    "which, match",
    [("nan", "NaN"), ("neg", "negative"), ("shape", "does not match"), ("reward", "finite"), ("gid", "gid")],
)
def test_bad_inputs_raise(which, match):
    ent, mask, r, gid, ng = token_batch([3, 2, 3], [1, 1, -1], ["g"] * 3)
    ent = torch.where(mask.bool(), ent, 0.0)
    if which == "nan":
        ent[1, 0] = float("nan")
    elif which == "neg":
        ent[0, 0] = -1.0
    elif which == "shape":
        mask = mask[:, :2]
    elif which == "reward":
        r = torch.tensor([1.0, float("inf"), -1.0])
    elif which == "gid":
        gid = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=match):
        grpo_s_advantages(ent, mask, r, gid, ng)


def test_detached_entropy():
    logits = torch.randn(3, 4, 5, requires_grad=True)
    lp = torch.log_softmax(logits, -1)
    ent = -(lp.exp() * lp).sum(-1)
    r, gid = torch.tensor([1.0, -1.0, 1.0]), torch.zeros(3, dtype=torch.long)
    adv, _ = grpo_s_advantages(ent, torch.ones(3, 4), r, gid, 1)
    assert adv.grad_fn is None and not adv.requires_grad


# ---------------------------------------------------------------------------------------------------------------------
# A2-T4 loss math: arithmetic-mean ratio, on-policy = 1, per-sequence clipping


def _lp(B=4, L=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, L, generator=g) * 3
    mask = torch.ones(B, L)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    return old, mask


def test_a2_t4_sequence_ratio_is_arithmetic_mean_and_one_on_policy():
    old, mask = _lp()
    delta = torch.tensor([[0.1, -0.3, 0.2, 0.0, 0.5], [0.4, -0.4, 0.1, 9.0, 9.0], [0.0] * 5, [0.7, 5, 5, 5, 5]])
    w = sequence_ratio(old + delta, old, mask)
    arith = torch.stack([torch.exp(delta[i][mask[i].bool()]).mean() for i in range(4)])
    geo = torch.stack([torch.exp(delta[i][mask[i].bool()].mean()) for i in range(4)])
    torch.testing.assert_close(w, arith)
    assert (w - geo)[:2].abs().min() > 1e-3  # not GSPO's geometric mean
    torch.testing.assert_close(sequence_ratio(old, old, mask), torch.ones(4))


def test_a2_t4_loss_matrix_closed_form_and_per_sequence_gradients():
    old, mask = _lp()
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])[:, None] * mask
    delta = torch.tensor(
        [[0.1, -0.1, 0.05, 0.0, 0.02], [0.0, 0.1, -0.1, 0.0, 0.0], [0.6, 0.6, 0.6, 0.6, 0.6], [-0.9, 0, 0, 0, 0]]
    )
    logp = (old + delta).requires_grad_(True)
    loss_mat, stats = grpo_s_loss_matrix(logp, old, adv, mask, 0.2, 0.28)
    w = sequence_ratio(logp.detach(), old, mask)
    a = adv[:, 0]
    expected = -torch.minimum(w * a, w.clamp(0.8, 1.28) * a)
    # each valid token carries its sequence loss; the row mean over valid tokens is l_i (paper: (1/G) sum_i l_i)
    torch.testing.assert_close(loss_mat, expected[:, None] * mask)
    per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1)
    torch.testing.assert_close(per_seq, expected)
    obj = per_seq.mean()
    obj.backward()
    ratio = torch.exp(delta)
    lens = mask.sum(-1, keepdim=True)
    grad_expected = -a[:, None] * ratio / lens / 4 * mask
    # row 2: A > 0 and w = e^0.6 > 1.28 -> clipped, zero gradient; row 3: A < 0 and w = (e^-0.9)/1 < 0.8 -> clipped
    grad_expected[2] = 0
    grad_expected[3] = 0
    torch.testing.assert_close(logp.grad, grad_expected, atol=1e-7, rtol=1e-6)
    assert stats["seq_clipped_high"].tolist() == [False, False, True, False]
    assert stats["seq_clipped_low"].tolist() == [False, False, False, True]


def test_a2_t4_clipping_is_per_sequence_not_per_token():
    # one token with ratio e^1 (outside the range) but the sequence mean inside it: every token keeps its gradient
    old = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    delta = torch.tensor([[1.0, -0.5, -0.5, -0.4]])
    logp = (old + delta).requires_grad_(True)
    w = float(torch.exp(delta).mean())
    assert 0.8 < w < 1.28
    loss_mat, _ = grpo_s_loss_matrix(logp, old, torch.ones(1, 4), mask, 0.2, 0.28)
    loss_mat.mean().backward()
    assert bool((logp.grad != 0).all())


def test_a2_t4_unclipped_side_keeps_gradient():
    old = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    logp = torch.tensor([[0.6, 0.6, 0.6], [-0.9, -0.9, -0.9]], requires_grad=True)
    # ratio above the range with A < 0, below it with A > 0: the min picks the unclipped term
    adv = torch.tensor([[-1.0] * 3, [1.0] * 3])
    loss_mat, stats = grpo_s_loss_matrix(logp, old, adv, mask, 0.2, 0.28)
    loss_mat.mean().backward()
    assert bool((logp.grad != 0).all())
    assert not stats["seq_clipped_high"].any() and not stats["seq_clipped_low"].any()


def test_loss_padding_gets_no_gradient_even_with_nan():
    old, mask = _lp()
    logp = old.clone()
    logp[~mask.bool()] = float("nan")
    logp.requires_grad_(True)
    loss_mat, _ = grpo_s_loss_matrix(logp, old, torch.ones_like(old), mask, 0.2, 0.28)
    assert torch.isfinite(loss_mat).all()
    loss_mat.sum().backward()
    assert torch.count_nonzero(logp.grad[~mask.bool()]) == 0 and torch.isfinite(logp.grad).all()


def test_sequence_ratio_clamps_the_token_log_ratio():
    """A token at log-ratio +-100 counts as exp(+-20) (the numerical guard), not as inf / 0."""
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = torch.tensor([[100.0, 0.0], [-100.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    w = sequence_ratio(logp, old, mask)
    torch.testing.assert_close(w, torch.tensor([(math.exp(20.0) + 1.0) / 2, math.exp(-20.0)], dtype=torch.float64))


def test_loss_matrix_bad_inputs():
    old, mask = _lp()
    with pytest.raises(ValueError, match="share one"):
        grpo_s_loss_matrix(old, old, old[:, :2], mask, 0.2, 0.28)
    with pytest.raises(ValueError, match="clip_low"):
        grpo_s_loss_matrix(old, old, old, mask, 1.2, 0.28)


# ---------------------------------------------------------------------------------------------------------------------
# the compiled kernel (gtpo/algorithms/kernels.py) against the definition (grpo_s.grpo_s_definition)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm_mode", ["joint", "zero_fill"])
def test_kernel_matches_definition(seed, norm_mode):
    from gtpo.algorithms.grpo_s import grpo_s_definition

    lengths, rewards, groups = _random_groups(300 + seed, reward_kind="01" if seed % 2 else "pm1")
    ent, mask, r, gid, ng = token_batch(lengths, rewards, groups, seed=seed)
    if seed >= 4:  # holes inside responses, and an integer mask
        mask = (mask * (torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) > 0.2)).long()
    p = GRPOSParams(beta1=0.8, beta2=0.1 + 0.3 * seed, std="population" if seed == 3 else "unbiased",
                    norm_mode=norm_mode)  # fmt: skip
    offset = -0.5 * torch.rand(len(r), generator=torch.Generator().manual_seed(seed)) if seed % 3 else None
    adv, diag = grpo_s_advantages(ent, mask, r, gid, ng, p, reward_offset=offset)
    ref, ref_diag = grpo_s_definition(ent, mask, r, gid, ng, p, reward_offset=offset)
    torch.testing.assert_close(adv, ref, rtol=1e-6, atol=1e-6)
    assert set(diag) - {"kernel_compile_s"} == set(ref_diag)
    for key, value in ref_diag.items():
        assert diag[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_slightly_negative_entropy_counts_as_zero_in_the_sequence_entropy():
    """An entropy within neg_entropy_tol below 0 (low-precision rounding) enters Hbar as 0, not as itself."""
    ent, mask, r, gid, ng = token_batch([3, 3, 2, 4], [1, 1, -1, -1], ["g"] * 4, seed=7)
    ent_neg, ent_zero = ent.clone(), ent.clone()
    ent_neg[0, 1], ent_zero[0, 1] = -0.05, 0.0
    a_neg, d_neg = grpo_s_advantages(ent_neg, mask, r, gid, ng)
    a_zero, d_zero = grpo_s_advantages(ent_zero, mask, r, gid, ng)
    assert torch.equal(a_neg, a_zero)
    assert d_neg["seq_entropy_correct_mean"] == d_zero["seq_entropy_correct_mean"]


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("correct", [True, False])
def test_kernel_refuses_a_half_and_clamps_a_slightly_negative_entropy(holes, correct):
    """On a valid token of a dense (or holed) row: a mask value 0.5 is refused as the definition refuses it, and an
    entropy within neg_entropy_tol below 0 enters Hbar as 0 exactly as in the definition."""
    from gtpo.algorithms.grpo_s import grpo_s_definition

    lengths, rewards, groups = _random_groups(41, reward_kind="pm1")
    ent, mask, r, gid, ng = token_batch(lengths, rewards, groups, seed=41)
    if holes:
        mask = mask * (torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)) > 0.2)
    rows = [i for i in range(len(r)) if bool(r[i] > 0) == correct and int(mask[i].sum()) >= 3]
    dense = [i for i in rows if int(mask[i].sum()) == int(mask[i].nonzero().max()) + 1]
    row = ([i for i in rows if i not in dense] if holes else dense)[0]
    col = int(mask[row].nonzero()[1])
    half = mask.clone()
    half[row, col] = 0.5
    with pytest.raises(ValueError, match="only 0 and 1"):
        grpo_s_advantages(ent, half, r, gid, ng)
    for value in (-0.05, -1e-7):
        bad = ent.clone()
        bad[row, col] = value
        adv, diag = grpo_s_advantages(bad, mask, r, gid, ng)
        ref, ref_diag = grpo_s_definition(bad, mask, r, gid, ng)
        torch.testing.assert_close(adv, ref, rtol=1e-6, atol=1e-6)
        for key, ref_value in ref_diag.items():
            assert diag[key] == pytest.approx(ref_value, rel=1e-9, abs=1e-12), key


def test_kernel_falls_back_to_the_definition(monkeypatch):
    from gtpo.algorithms import kernel_dispatch
    from gtpo.algorithms.grpo_s import grpo_s_definition

    monkeypatch.setattr(kernel_dispatch, "_OFF", {"grpo_s"})
    lengths, rewards, groups = _random_groups(9)
    ent, mask, r, gid, ng = token_batch(lengths, rewards, groups)
    adv, _ = grpo_s_advantages(ent, mask, r, gid, ng)
    ref, _ = grpo_s_definition(ent, mask, r, gid, ng)
    assert torch.equal(adv, ref)
