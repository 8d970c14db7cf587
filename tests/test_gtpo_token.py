"""GTPO-token (arXiv 2508.04349, Eq. 3/5/6): claims A1-T1..T9 of docs/ALGORITHMS.md §8.1, worked values, edge cases.

Run: cd /work/main && .venv/bin/pytest -q tests/test_gtpo_token.py
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from gtpo.algorithms.gtpo_token import (
    GTPOParams,
    active_counts,
    entropy_shares,
    gtpo_shaped_rewards,
    gtpo_token_advantages,
)
from tests.support.estimators import gtpo_loop_reference, random_token_batch, token_batch

# ---------------------------------------------------------------------------------------------------------------------
# helpers

# The equations as typeset with the split reading of Eq. 6 (the recipe's defaults before paper A's text was read):
# the tests below that are about split / per-group behaviour pin it; the paper's defaults are tested in
# tests/test_gtpo_zero_fill.py.
AS_TYPESET_SPLIT = {"norm_mode": "split", "norm_scope": "group", "weight_scope": "group"}


def _typeset(**kwargs) -> GTPOParams:
    return GTPOParams(**{**AS_TYPESET_SPLIT, **kwargs})


def _ppo_token_mean_loss(logp, old_logp, adv, mask, lo=0.2, hi=0.28):
    ratio = torch.exp(logp - old_logp)
    s = torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)
    return -(s * mask).sum() / mask.sum()


# ---------------------------------------------------------------------------------------------------------------------
# worked examples (textpolicy's cases, docs/ALGORITHMS.md §3.8 / §8.1)


def test_worked_example_mixed_group():
    ent = torch.tensor([[3.0, 1.0], [1.0, 3.0], [2.0, 2.0]])
    mask = torch.ones(3, 2)
    r = torch.tensor([1.0, 1.0, -1.0])
    gid = torch.zeros(3, dtype=torch.long)
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, 1, _typeset(alpha1=1.0, alpha2=0.1))
    # by hand: 1 + 0.1 * 3/4 * 2 = 1.15, 1 + 0.1 * 1/4 * 2 = 1.05, -1 - 0.1 * (1/2)/(1) * 1 = -1.1
    expected = torch.tensor([[1.15, 1.05], [1.05, 1.15], [-1.1, -1.1]], dtype=torch.float64)
    torch.testing.assert_close(shaped, expected, atol=1e-6, rtol=0)


def test_worked_example_all_wrong():
    ent = torch.tensor([[4.0, 1.0], [1.0, 4.0]])
    shaped = gtpo_shaped_rewards(
        ent, torch.ones(2, 2), torch.tensor([-1.0, -1.0]), torch.zeros(2, dtype=torch.long), 1, _typeset()
    )
    # inverse entropies 1/4, 1 -> shares 0.2, 0.8, times h=2 -> 0.4, 1.6: -1 - 0.04 = -1.04, -1 - 0.16 = -1.16
    expected = torch.tensor([[-1.04, -1.16], [-1.16, -1.04]], dtype=torch.float64)
    torch.testing.assert_close(shaped, expected, atol=1e-6, rtol=0)


def test_worked_example_split_advantages_by_hand():
    # positives: shaped values {1.15, 1.05, 1.05, 1.15}: mean 1.1, unbiased std sqrt(4*0.0025/3)
    ent = torch.tensor([[3.0, 1.0], [1.0, 3.0], [2.0, 2.0]])
    r, gid = torch.tensor([1.0, 1.0, -1.0]), torch.zeros(3, dtype=torch.long)
    adv, _ = gtpo_token_advantages(ent, torch.ones(3, 2), r, gid, 1, _typeset())
    a = 0.05 / (math.sqrt(4 * 0.0025 / 3) + 1e-6)
    expected = torch.tensor([[a, -a], [-a, a], [0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# A1-T1 conservation


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a1_t1_conservation_with_alpha_sum_one(seed):
    ent, mask, r, gid, ng = random_token_batch(seed, allow_empty=True)
    p = _typeset(alpha1=0.9, alpha2=0.1)
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, p)
    correct = r > 0
    d, h = active_counts(mask, correct, gid, ng)
    m = mask.bool()
    sum_pos = torch.zeros(ng, mask.shape[1], dtype=torch.float64).index_add_(
        0, gid, torch.where(m & correct[:, None], shaped, 0.0)
    )
    sum_neg = torch.zeros(ng, mask.shape[1], dtype=torch.float64).index_add_(
        0, gid, torch.where(m & ~correct[:, None], shaped, 0.0)
    )
    # sum over O+_t equals d_t, over O-_t equals -h_t (up to the eps guard, ~a2*eps*d/sum H)
    torch.testing.assert_close(sum_pos, d, atol=1e-5, rtol=0)
    torch.testing.assert_close(sum_neg, -h, atol=1e-5, rtol=0)


def test_a1_t1_negative_control_alpha_sum_not_one():
    ent = torch.tensor([[3.0, 1.0], [1.0, 3.0], [2.0, 2.0]])
    r, gid = torch.tensor([1.0, 1.0, -1.0]), torch.zeros(3, dtype=torch.long)
    shaped = gtpo_shaped_rewards(ent, torch.ones(3, 2), r, gid, 1, _typeset())
    col_sum = shaped[:2].sum(0)
    # alpha1 + alpha2 = 1.1: the sum is 2.2, not d_t = 2
    torch.testing.assert_close(col_sum, torch.tensor([2.2, 2.2], dtype=torch.float64), atol=1e-6, rtol=0)
    assert (col_sum - 2.0).abs().min() > 0.19


def test_a1_t1_general_form_with_non_binary_rewards_and_offset():
    ent, mask, _, gid, ng = token_batch([4, 3, 2, 4], [1, 1, -1, -1], ["a"] * 4, seed=3)
    r = torch.tensor([1.0, 0.7, -1.0, -1.0])
    offset = torch.tensor([-0.2, 0.0, -0.3, 0.0])
    p = _typeset(alpha1=1.0, alpha2=0.1)
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, p, reward_offset=offset)
    m = mask.bool()
    base = torch.tensor([0.8, 0.7, -1.3, -1.0], dtype=torch.float64)
    for t in range(mask.shape[1]):
        P = [b for b in range(2) if m[b, t]]
        N = [b for b in range(2, 4) if m[b, t]]
        assert abs(float(shaped[P, t].sum()) - (float(base[P].sum()) + 0.1 * len(P))) < 1e-6
        assert abs(float(shaped[N, t].sum()) - (float(base[N].sum()) - 0.1 * len(N))) < 1e-6
    _, diag = gtpo_token_advantages(ent, mask, r, gid, ng, p, reward_offset=offset)
    assert diag["conservation_err"] < 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# A1-T2 uniform entropy / alpha2 = 0 -> GRPO-like


def test_a1_t2_uniform_entropy_shaped_rewards_constant_and_split_zero():
    ent, mask, r, gid, ng = token_batch([5, 3, 4, 2, 5], [1, 1, -1, -1, 1], list("aabbb"))
    ent = torch.where(mask.bool(), torch.full_like(ent, 1.7), ent)
    p = _typeset()
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, p)
    m = mask.bool()
    pos, neg = m & (r > 0)[:, None], m & (r <= 0)[:, None]
    assert torch.allclose(shaped[pos], torch.full_like(shaped[pos], 1.1), atol=1e-6)
    assert torch.allclose(shaped[neg], torch.full_like(shaped[neg], -1.1), atol=1e-6)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, p)
    assert torch.count_nonzero(adv) == 0


def test_a1_t2_alpha2_zero_split_is_zero():
    ent, mask, r, gid, ng = random_token_batch(4)
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, _typeset(alpha2=0.0))
    m = mask.bool()
    assert torch.equal(shaped[m], torch.where(r > 0, 1.0, -1.0).double()[:, None].expand_as(shaped)[m])
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset(alpha2=0.0))
    assert torch.count_nonzero(adv) == 0


@pytest.mark.parametrize("alpha2", [0.0, 0.1])
@pytest.mark.parametrize("reward_kind", ["pm1", "01"])
def test_a1_t2_joint_equal_lengths_matches_verl_grpo(alpha2, reward_kind):
    """Equal lengths per group, uniform entropy: joint token whitening (population std) == verl GRPO * sqrt(G/(G-1))."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rng = random.Random(7)
    lengths, rewards, groups = [], [], []
    for k, size in enumerate([2, 3, 4, 5, 6]):
        ell = rng.randint(1, 6)
        outcomes = [1, 0] + [rng.randint(0, 1) for _ in range(size - 2)]
        for o in outcomes:
            lengths.append(ell)
            rewards.append(float(o) if reward_kind == "01" else (1.0 if o else -1.0))
            groups.append(f"g{k}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    lengths, rewards, groups = ([x[i] for i in order] for x in (lengths, rewards, groups))
    ent, mask, r, gid, ng = token_batch(lengths, rewards, groups, L=6)
    ent = torch.where(mask.bool(), torch.full_like(ent, 0.9), ent)
    p = _typeset(alpha2=alpha2, norm_mode="joint", std="population")
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, p)
    tlr = torch.zeros_like(mask)
    tlr[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = r
    grpo, _ = compute_grpo_outcome_advantage(tlr, mask, np.asarray(groups, dtype=object))
    sizes = torch.bincount(gid).double()[gid]
    scale = torch.sqrt(sizes / (sizes - 1)).float()[:, None]
    torch.testing.assert_close(adv, grpo * scale * mask, atol=2e-5, rtol=1e-5)


def test_a1_t2_joint_variable_lengths_is_token_whitening_of_constants():
    ent, mask, r, gid, ng = token_batch([5, 2, 4, 1, 3], [1, -1, -1, 1, 1], ["x"] * 5)
    ent = torch.where(mask.bool(), torch.full_like(ent, 2.0), ent)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset(norm_mode="joint"))
    m = mask.bool()
    c = torch.where(r > 0, 1.1, -1.1).double()[:, None].expand_as(mask)[m]
    expected = (c - c.mean()) / (c.std() + 1e-6)
    torch.testing.assert_close(adv[m].double(), expected, atol=1e-5, rtol=0)
    # same sign as GRPO (correct > 0 > incorrect), magnitudes length-weighted
    assert bool((adv[m & (r > 0)[:, None]] > 0).all()) and bool((adv[m & (r <= 0)[:, None]] < 0).all())


# ---------------------------------------------------------------------------------------------------------------------
# A1-T3 sign, A1-T4 monotonicity, A1-T5 bounds


@pytest.mark.parametrize("seed", [0, 5])
def test_a1_t3_t5_sign_and_bounds(seed):
    ent, mask, r, gid, ng = random_token_batch(seed)
    p = _typeset(alpha1=1.0, alpha2=0.3)
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, p)
    m = mask.bool()
    correct = r > 0
    d, h = active_counts(mask, correct, gid, ng)
    pos, neg = m & correct[:, None], m & ~correct[:, None]
    assert bool((shaped[pos] >= 1.0).all())
    assert bool((shaped[neg] <= -1.0).all())
    assert bool((shaped[pos] <= (1.0 + 0.3 * d[gid])[pos] + 1e-12).all())
    assert bool((shaped[neg] >= (-1.0 - 0.3 * h[gid])[neg] - 1e-12).all())
    # the count-scaled weight averages to 1 over the active set at each position
    sp, sn = entropy_shares(ent, mask, correct, gid, ng, weight_scope="group")
    wsum_pos = torch.zeros_like(d).index_add_(0, gid, sp * d[gid])
    torch.testing.assert_close(wsum_pos, d, atol=1e-5, rtol=0)
    wsum_neg = torch.zeros_like(h).index_add_(0, gid, sn * h[gid])
    torch.testing.assert_close(wsum_neg, h, atol=1e-5, rtol=0)


def test_a1_t4_monotonicity():
    ent = torch.tensor([[0.5], [1.0], [2.5], [0.3], [1.2], [4.0]])
    r = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    shaped = gtpo_shaped_rewards(ent, torch.ones(6, 1), r, torch.zeros(6, dtype=torch.long), 1, _typeset())[:, 0]
    assert shaped[0] < shaped[1] < shaped[2]
    # confident mistakes (low entropy) are penalised harder
    assert shaped[3] < shaped[4] < shaped[5]


# ---------------------------------------------------------------------------------------------------------------------
# A1-T6 variable lengths


def test_a1_t6_variable_lengths_counts_and_padding():
    ent, mask, r, gid, ng = token_batch([4, 2, 3], [1, 1, -1], ["g"] * 3, L=5)
    d, h = active_counts(mask, r > 0, gid, ng)
    assert d[0].tolist() == [2, 2, 1, 1, 0]
    assert h[0].tolist() == [1, 1, 1, 0, 0]
    assert bool((d[0, 1:] <= d[0, :-1]).all()) and bool((h[0, 1:] <= h[0, :-1]).all())
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset())
    assert torch.count_nonzero(adv[~mask.bool()]) == 0
    assert torch.isfinite(adv).all()


def test_padding_values_never_read():
    ent, mask, r, gid, ng = random_token_batch(11)
    clean = torch.where(mask.bool(), ent, torch.zeros_like(ent))
    junk = torch.where(mask.bool(), ent, torch.full_like(ent, -1e30))
    for p in (_typeset(), _typeset(norm_mode="joint", norm_scope="batch")):
        a_nan, _ = gtpo_token_advantages(ent, mask, r, gid, ng, p)
        a_clean, _ = gtpo_token_advantages(clean, mask, r, gid, ng, p)
        a_junk, _ = gtpo_token_advantages(junk, mask, r, gid, ng, p)
        assert torch.equal(a_nan, a_clean) and torch.equal(a_junk, a_clean)
        assert torch.count_nonzero(a_clean[~mask.bool()]) == 0


# ---------------------------------------------------------------------------------------------------------------------
# A1-T7 alpha invariance of split, A1-T9 split normalisation


def test_a1_t7_split_alpha_invariant_joint_not():
    ent, mask, r, gid, ng = random_token_batch(21, allow_single=False)
    outs_split = [
        gtpo_token_advantages(ent, mask, r, gid, ng, _typeset(alpha1=a1, alpha2=a2))[0]
        for a1, a2 in [(1.0, 0.1), (0.5, 2.0), (3.0, 0.5)]
    ]
    for o in outs_split[1:]:
        torch.testing.assert_close(o, outs_split[0], atol=1e-4, rtol=1e-4)
    outs_joint = [
        gtpo_token_advantages(ent, mask, r, gid, ng, _typeset(alpha1=a1, alpha2=a2, norm_mode="joint"))[0]
        for a1, a2 in [(1.0, 0.1), (0.5, 2.0)]
    ]
    assert (outs_joint[0] - outs_joint[1]).abs().max() > 0.1


@pytest.mark.parametrize("scope", ["group", "batch"])
def test_a1_t9_split_sets_have_mean0_std1(scope):
    ent, mask, r, gid, ng = random_token_batch(8, allow_single=False, allow_empty=False)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset(norm_scope=scope))
    adv = adv.double()
    m = mask.bool()
    correct = r > 0
    scopes = range(ng) if scope == "group" else [None]
    for g in scopes:
        rows = torch.ones_like(correct) if g is None else gid == g
        for sel_rows in (rows & correct, rows & ~correct):
            sel = m & sel_rows[:, None]
            if int(sel_rows.sum()) < 2:
                # one response: d_t = 1 everywhere, its shaped rewards are constant -> advantage 0
                assert torch.count_nonzero(adv[sel]) == 0
                continue
            v = adv[sel]
            assert abs(float(v.mean())) < 1e-6
            assert abs(float(v.std()) - 1.0) < 1e-3  # 1 up to eps / std(shaped)


# ---------------------------------------------------------------------------------------------------------------------
# A1-T8 detachment (through the shaping and the PPO loss)


def test_a1_t8_no_gradient_reaches_entropy():
    torch.manual_seed(0)
    B, L, V = 6, 5, 7
    logits = torch.randn(B, L, V, requires_grad=True)
    tokens = torch.randint(0, V, (B, L))
    mask = torch.ones(B, L)
    mask[1, 3:] = 0
    mask[4, 2:] = 0
    logp_all = torch.log_softmax(logits, -1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    assert ent.requires_grad
    r = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, 2, _typeset())
    assert not adv.requires_grad and adv.grad_fn is None
    logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    loss = _ppo_token_mean_loss(logp, logp.detach() - 0.05, adv, mask)
    loss.backward()
    g_full = logits.grad.clone()
    # the same loss with the entropy cut off by hand: identical gradient, so none flowed through H
    logits.grad = None
    adv2, _ = gtpo_token_advantages(ent.detach(), mask, r, gid, 2, _typeset())
    logp_all2 = torch.log_softmax(logits, -1)
    logp2 = logp_all2.gather(-1, tokens[..., None]).squeeze(-1)
    _ppo_token_mean_loss(logp2, logp2.detach() - 0.05, adv2, mask).backward()
    assert torch.equal(g_full, logits.grad)
    # a separate leaf used only for the entropy gets no gradient at all
    ent_leaf = ent.detach().clone().requires_grad_(True)
    adv3, _ = gtpo_token_advantages(ent_leaf, mask, r, gid, 2, _typeset())
    assert adv3.grad_fn is None
    # padding: no gradient
    assert torch.count_nonzero(logits.grad[~mask.bool()]) == 0


# ---------------------------------------------------------------------------------------------------------------------
# loop reference vs vectorised code


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["split", "joint"])
@pytest.mark.parametrize("scope", ["group", "batch"])
def test_vectorised_matches_loop_reference(seed, mode, scope):
    ent, mask, r, gid, ng = random_token_batch(100 + seed, reward_kind="pm1" if seed % 2 else "01")
    std = "unbiased" if seed % 3 else "population"
    p = _typeset(alpha1=1.0, alpha2=0.1 + 0.2 * seed, norm_mode=mode, norm_scope=scope, std=std)
    offset = None
    if seed % 2:
        offset = -0.5 * torch.rand(len(r), generator=torch.Generator().manual_seed(seed))
    shaped_ref, adv_ref = gtpo_loop_reference(ent, mask, r, gid, p, offset)
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, p, reward_offset=offset)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, p, reward_offset=offset)
    torch.testing.assert_close(shaped, shaped_ref, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(adv.double(), adv_ref, atol=1e-5, rtol=1e-5)


def test_row_order_does_not_matter():
    ent, mask, r, gid, ng = random_token_batch(42)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset())
    perm = torch.randperm(len(r), generator=torch.Generator().manual_seed(1))
    adv_p, _ = gtpo_token_advantages(ent[perm], mask[perm], r[perm], gid[perm], ng, _typeset())
    torch.testing.assert_close(adv_p, adv[perm], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# edge cases (docs/ALGORITHMS.md §3.6)


def test_all_correct_group_gets_entropy_rank_signal():
    ent, mask, r, gid, ng = token_batch([3, 3, 3], [1, 1, 1], ["a"] * 3, seed=2)
    adv, diag = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset())
    assert torch.count_nonzero(adv) > 0
    # at each position, the advantage orders like the entropy
    for t in range(3):
        assert torch.equal(torch.argsort(adv[:, t]), torch.argsort(ent[:, t]))
    assert diag["frac_groups_all_correct"] == 1.0 and diag["frac_groups_all_wrong"] == 0.0


def test_all_wrong_group_lower_entropy_lower_advantage():
    ent, mask, r, gid, ng = token_batch([3, 3, 3], [-1, -1, -1], ["a"] * 3, seed=4)
    adv, diag = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset())
    for t in range(3):
        assert torch.equal(torch.argsort(adv[:, t]), torch.argsort(ent[:, t]))
    assert diag["frac_groups_all_wrong"] == 1.0


def test_single_active_token_weight_one():
    # position 3: only row 0 is active among the correct ones (d_t = 1)
    ent, mask, r, gid, ng = token_batch([4, 2, 3], [1, 1, -1], ["g"] * 3, L=4)
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, _typeset())
    assert abs(float(shaped[0, 3]) - 1.1) < 1e-6
    # position 2 on the negative side: h_t = 1
    assert abs(float(shaped[2, 2]) + 1.1) < 1e-6


def test_single_response_group_zero_under_group_scope():
    ent, mask, r, gid, ng = token_batch([4, 3, 3, 2, 3], [1, 1, 1, -1, -1], ["solo", "g", "g", "g", "h"], seed=6)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset())
    assert torch.count_nonzero(adv[0]) == 0 and torch.count_nonzero(adv[4]) == 0
    assert torch.count_nonzero(adv[1:4]) > 0
    adv_b, _ = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset(norm_scope="batch"))
    assert torch.count_nonzero(adv_b[0]) > 0


def test_empty_response_takes_no_part():
    ent, mask, r, gid, ng = token_batch([4, 2, 3, 3], [1, 1, -1, -1], ["g"] * 4, L=4, seed=9)
    ent_e = torch.cat([ent, torch.full((2, 4), float("nan"))])
    mask_e = torch.cat([mask, torch.zeros(2, 4)])
    r_e = torch.cat([r, torch.tensor([1.0, -1.0])])
    gid_e = torch.cat([gid, torch.zeros(2, dtype=torch.long)])
    for p in (_typeset(), _typeset(norm_mode="joint"), _typeset(norm_scope="batch")):
        a, _ = gtpo_token_advantages(ent, mask, r, gid, ng, p)
        a_e, _ = gtpo_token_advantages(ent_e, mask_e, r_e, gid_e, ng, p)
        assert torch.equal(a_e[:4], a) and torch.count_nonzero(a_e[4:]) == 0
    d, h = active_counts(mask_e, r_e > 0, gid_e, ng)
    assert d[0].tolist() == [2, 2, 1, 1] and h[0].tolist() == [2, 2, 2, 0]


def test_all_zero_entropy():
    ent, mask, r, gid, ng = token_batch([3, 3, 3, 3], [1, 1, -1, -1], ["g"] * 4)
    ent = torch.where(mask.bool(), torch.zeros_like(ent), ent)
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, _typeset())
    # positive side: weight 0/(0+eps) = 0 -> r~ = a1 * r (conservation breaks); negative side: 1/h_t each
    assert torch.equal(shaped[:2], torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(shaped[2:], torch.full((2, 3), -1.1, dtype=torch.float64), atol=1e-9, rtol=0)
    adv, diag = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset())
    assert torch.count_nonzero(adv) == 0
    assert abs(diag["conservation_err"] - 0.2) < 1e-9  # a2 * d_t = 0.1 * 2 lost on the positive side
    # a zero advantage is neither positive nor negative
    assert diag["frac_tokens_adv_pos"] == 0.0 and diag["frac_tokens_adv_neg"] == 0.0
    assert diag["adv_pos_mean"] == 0.0 and diag["adv_neg_mean"] == 0.0 and diag["adv_abs_mean"] == 0.0
    # zero_fill keeps the polarity signal: every correct token positive, every incorrect one negative (6 of 12 each)
    adv, diag = gtpo_token_advantages(ent, mask, r, gid, ng)
    assert diag["frac_tokens_adv_pos"] == 0.5 and diag["frac_tokens_adv_neg"] == 0.5


def test_zero_variance_tolerance_needed_for_uniform_small_entropy():
    """Exactly uniform entropy with variable lengths: the eps guards leave a ~a2*eps/H spread (§3.6)."""
    ent, mask, r, gid, ng = token_batch([4, 2, 3, 1], [1, 1, -1, -1], ["g"] * 4, L=4)
    ent = torch.where(mask.bool(), torch.full_like(ent, 0.01), ent)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset())
    assert torch.count_nonzero(adv) == 0
    raw, _ = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset(zero_var_rtol=0.0))
    assert raw.abs().max() > 0.1  # rounding turned into sizeable advantages without the tolerance


def test_small_negative_entropy_is_clamped():
    ent, mask, r, gid, ng = token_batch([3, 3, 2], [1, 1, -1], ["g"] * 3, seed=1)
    ent_neg = ent.clone()
    ent_neg[0, 1] = -0.003
    ent_zero = ent.clone()
    ent_zero[0, 1] = 0.0
    a1, _ = gtpo_token_advantages(ent_neg, mask, r, gid, ng, _typeset())
    a2, _ = gtpo_token_advantages(ent_zero, mask, r, gid, ng, _typeset())
    assert torch.equal(a1, a2)


def test_negative_base_choices():
    ent, mask, _, gid, ng = token_batch([3, 3, 3, 3], [1, 1, -1, -1], ["g"] * 4, seed=5)
    r = torch.tensor([1.0, 0.8, -1.0, -1.4])  # e.g. a +-1 reward with an overlong penalty folded in
    s_lit = gtpo_shaped_rewards(ent, mask, r, gid, ng, _typeset(negative_base="minus_one"))
    s_rew = gtpo_shaped_rewards(ent, mask, r, gid, ng, _typeset(negative_base="reward"))
    torch.testing.assert_close(s_lit[:3], s_rew[:3])
    torch.testing.assert_close(s_rew[3] - s_lit[3], torch.full((3,), -0.4, dtype=torch.float64))
    # 0/1 rewards: "reward" would make the incorrect base 0 -> rejected
    with pytest.raises(ValueError, match="negative_base"):
        r01 = torch.tensor([1.0, 1.0, 0.0, 0.0])
        gtpo_token_advantages(ent, mask, r01, gid, ng, _typeset(negative_base="reward"))
    # 0/1 rewards under the default: incorrect base is -1, same as +-1 rewards
    a01, _ = gtpo_token_advantages(ent, mask, torch.tensor([1.0, 1.0, 0.0, 0.0]), gid, ng, _typeset())
    apm, _ = gtpo_token_advantages(ent, mask, torch.tensor([1.0, 1.0, -1.0, -1.0]), gid, ng, _typeset())
    assert torch.equal(a01, apm)


def test_diagnostics_keys_and_values():
    ent, mask, r, gid, ng = random_token_batch(3)
    _, diag = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset())
    expected = {
        "weight_pos_mean", "weight_pos_std", "weight_pos_max", "weight_neg_mean", "weight_neg_std", "weight_neg_max",
        "shaped_correct_mean", "shaped_incorrect_mean", "adv_correct_mean", "adv_incorrect_mean", "adv_pos_mean",
        "adv_neg_mean", "adv_abs_mean", "frac_tokens_adv_pos", "frac_tokens_adv_neg", "conservation_err",
        "frac_groups_all_correct", "frac_groups_all_wrong", "entropy_correct_mean", "entropy_incorrect_mean",
    }  # fmt: skip
    assert set(diag) == expected
    assert all(isinstance(v, float) and math.isfinite(v) for v in diag.values())
    assert abs(diag["weight_pos_mean"] - 1.0) < 1e-5 and abs(diag["weight_neg_mean"] - 1.0) < 1e-5
    assert diag["adv_pos_mean"] > 0 > diag["adv_neg_mean"]
    assert 0 < diag["frac_tokens_adv_pos"] + diag["frac_tokens_adv_neg"] <= 1


# ---------------------------------------------------------------------------------------------------------------------
# bad inputs and bad params


def _good():
    return token_batch([3, 2, 3], [1, 1, -1], ["g"] * 3, seed=0)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda e, m, r, g: (
                torch.where(m.bool(), e, 0.0).index_put_(
                    (torch.tensor([0]), torch.tensor([1])), torch.tensor(float("nan"))
                ),
                m,
                r,
                g,
            ),
            "NaN",
        ),
        (
            lambda e, m, r, g: (
                torch.where(m.bool(), e, 0.0).index_put_(
                    (torch.tensor([0]), torch.tensor([0])), torch.tensor(float("inf"))
                ),
                m,
                r,
                g,
            ),
            "inf",
        ),
        (lambda e, m, r, g: (torch.where(m.bool(), e, 0.0) - 2.0, m, r, g), "negative"),
        (lambda e, m, r, g: (e[:, :2], m, r, g), "does not match"),
        (lambda e, m, r, g: (e[0], m, r, g), "entropy must be"),
        (lambda e, m, r, g: (e.long(), m, r, g), "floating point"),
        (lambda e, m, r, g: (e, m * 2, r, g), "only 0 and 1"),
        (lambda e, m, r, g: (e, m, r[:2], g), "rewards must have shape"),
        (lambda e, m, r, g: (e, m, torch.tensor([1.0, float("nan"), -1.0]), g), "finite"),
        (lambda e, m, r, g: (e, m, r, g[:2]), "gid must have shape"),
        (lambda e, m, r, g: (e, m, r, g + 5), "gid values"),
        (lambda e, m, r, g: (e, m, r, g.float()), "integer"),
    ],
)
def test_bad_inputs_raise(mutate, match):
    ent, mask, r, gid, ng = _good()
    e2, m2, r2, g2 = mutate(ent, mask, r, gid)
    with pytest.raises(ValueError, match=match):
        gtpo_token_advantages(e2, m2, r2, g2, ng, _typeset())


def test_nan_on_padding_is_not_an_error():
    ent, mask, r, gid, ng = _good()
    assert torch.isnan(ent[~mask.bool()]).all()
    gtpo_token_advantages(ent, mask, r, gid, ng, _typeset())


def test_non_positive_correct_reward_raises():
    ent, mask, _, gid, ng = _good()
    with pytest.raises(ValueError, match="correct"):
        gtpo_token_advantages(ent, mask, torch.tensor([1.0, -0.2, -1.0]), gid, ng, _typeset(reward_threshold=-0.5))


def test_bad_reward_offset_raises():
    ent, mask, r, gid, ng = _good()
    with pytest.raises(ValueError, match="reward_offset"):
        gtpo_token_advantages(ent, mask, r, gid, ng, _typeset(), reward_offset=torch.zeros(2))


def test_conflict_mask_needs_responses():
    ent, mask, r, gid, ng = _good()
    with pytest.raises(ValueError, match="responses"):
        gtpo_token_advantages(ent, mask, r, gid, ng, _typeset(conflict_mask=True))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"alpha1": -1.0}, "alpha1"),
        ({"alpha2": -0.1}, "alpha2"),
        ({"alpha1": 0.0, "alpha2": 0.0}, "alpha1"),
        ({"alpha2": float("nan")}, "alpha2"),
        ({"alpha2": "0.1"}, "alpha2"),
        ({"alpha1": True}, "alpha1"),
        ({"eps": 0.0}, "eps"),
        ({"eps": 0.5}, "eps"),
        ({"reward_threshold": float("inf")}, "reward_threshold"),
        ({"norm_mode": "both"}, "norm_mode"),
        ({"norm_scope": "token"}, "norm_scope"),
        ({"std": "biased"}, "std"),
        ({"negative_base": "zero"}, "negative_base"),
        ({"zero_var_rtol": -1e-3}, "zero_var_rtol"),
        ({"zero_var_rtol": 1.0}, "zero_var_rtol"),
        ({"neg_entropy_tol": -1.0}, "neg_entropy_tol"),
        ({"conflict_mask": 1}, "conflict_mask"),
        ({"conflict_lam_pos": -2.0}, "conflict_lam_pos"),
        ({"conflict_lam_neg": -0.5}, "conflict_lam_neg"),
    ],
)
def test_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        GTPOParams(**kwargs)


def test_params_frozen():
    p = GTPOParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.alpha1 = 2.0  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------------------------
# composition with GTPO-trajectory conflict weights


def _conflict_weights():
    from gtpo.algorithms.conflict_tokens import conflict_weights

    return conflict_weights


def test_conflict_mask_composition_by_hand():
    conflict_weights = _conflict_weights()
    # correct [5, 6, 7] and incorrect [5, 6, 9]: shared leading run at t = 0, 1 (no shared trailing run)
    responses = torch.tensor([[5, 6, 7], [5, 6, 9], [3, 3, 3], [3, 4, 4]])
    mask = torch.ones(4, 3)
    ent = torch.tensor([[1.0, 2.0, 0.5], [0.7, 1.5, 2.0], [1.0, 1.1, 1.2], [0.4, 0.9, 2.2]])
    r = torch.tensor([1.0, -1.0, 1.0, 1.0])
    gid = torch.tensor([0, 0, 1, 1])
    p = _typeset(conflict_mask=True)
    base, _ = gtpo_token_advantages(ent, mask, r, gid, 2, _typeset())
    adv, diag = gtpo_token_advantages(ent, mask, r, gid, 2, p, responses=responses)
    lam_expected = torch.tensor([[2.0, 2.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(adv, base * lam_expected)
    polarity = torch.tensor([1, -1, 1, 1], dtype=torch.int8)
    lam, is_conflict = conflict_weights(responses, mask, gid, 2, polarity, 2.0, 0.0)
    torch.testing.assert_close(adv, base * lam)
    assert abs(diag["conflict_token_frac"] - 4 / 12) < 1e-9


def test_conflict_mask_random_equals_direct_product():
    conflict_weights = _conflict_weights()
    ent, mask, r, gid, ng = random_token_batch(77, L=6)
    g = torch.Generator().manual_seed(3)
    responses = torch.randint(0, 3, mask.shape, generator=g) * mask.long()
    p = _typeset(conflict_mask=True, conflict_lam_pos=1.5, conflict_lam_neg=0.25, norm_mode="joint")
    base, _ = gtpo_token_advantages(ent, mask, r, gid, ng, _typeset(norm_mode="joint"))
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, p, responses=responses)
    nonempty = mask.bool().any(-1)
    polarity = (torch.where(r > 0, 1, -1) * nonempty).to(torch.int8)
    lam, _ = conflict_weights(responses, mask, gid, ng, polarity, 1.5, 0.25)
    torch.testing.assert_close(adv, base * lam, atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(adv[~mask.bool()]) == 0


# ---------------------------------------------------------------------------------------------------------------------
# A1-T10 corollary: entropy -> 0 uniformly gives the constant a1 * r + a2 (down to the eps guard)


@pytest.mark.parametrize("level", [1e-1, 1e-2, 1e-3])
def test_a1_t10_uniform_entropy_to_zero_tends_to_constant(level):
    ent, mask, r, gid, ng = token_batch([4, 2, 3, 3], [1, 1, -1, -1], ["g"] * 4, L=4)
    ent = torch.where(mask.bool(), torch.full_like(ent, level), ent)
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, _typeset())
    m = mask.bool()
    pos, neg = m & (r > 0)[:, None], m & (r <= 0)[:, None]
    # deviation is a2 * eps / (d_t * H) at most: the eps guard, not the formula, sets the limit as H -> 0
    tol = 0.1 * 1e-6 / level + 1e-12
    assert (shaped[pos] - 1.1).abs().max() <= tol
    assert (shaped[neg] + 1.1).abs().max() <= 0.1 * 1e-6 * level + 1e-12
