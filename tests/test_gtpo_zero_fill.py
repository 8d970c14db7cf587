"""GTPO as paper A writes it: zero-filled Eq. 6 and batch-level entropy shares (docs/ALGORITHMS.md §0, §3.3, §8.1).

Run: .venv/bin/python -m pytest -q tests/test_gtpo_zero_fill.py
"""

from __future__ import annotations

import math

import pytest
import torch

from gtpo.algorithms.conflict_tokens import conflict_weights
from gtpo.algorithms.gtpo_token import GTPOParams, gtpo_shaped_rewards, gtpo_token_advantages, gtpo_token_definition
from tests.support.estimators import gtpo_loop_reference, random_token_batch, token_batch


def test_defaults_are_the_papers():
    p = GTPOParams()
    assert (p.norm_mode, p.norm_scope, p.weight_scope) == ("zero_fill", "batch", "batch")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm_scope", ["batch", "group"])
@pytest.mark.parametrize("weight_scope", ["batch", "group"])
@pytest.mark.parametrize("conflict", [False, True])
def test_zero_fill_matches_loop_reference(seed, norm_scope, weight_scope, conflict):
    # unequal groups, shuffled rows, empty rows (allow_empty), single-response groups
    ent, mask, r, gid, ng = random_token_batch(200 + seed, reward_kind="pm1" if seed % 2 else "01")
    p = GTPOParams(
        alpha2=0.1 + 0.3 * seed,
        norm_scope=norm_scope,
        weight_scope=weight_scope,
        std="population" if seed == 3 else "unbiased",
        conflict_mask=conflict,
    )
    offset = -0.4 * torch.rand(len(r), generator=torch.Generator().manual_seed(seed)) if seed % 2 else None
    shaped_ref, adv_ref = gtpo_loop_reference(ent, mask, r, gid, p, offset)
    responses = None
    if conflict:
        responses = torch.randint(0, 2, mask.shape, generator=torch.Generator().manual_seed(seed)) * mask.long()
        polarity = (torch.where(r > 0, 1, -1) * mask.bool().any(-1)).to(torch.int8)
        lam, _ = conflict_weights(responses, mask, gid, ng, polarity, p.conflict_lam_pos, p.conflict_lam_neg)
        adv_ref = adv_ref * lam.double()
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, p, reward_offset=offset)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, p, reward_offset=offset, responses=responses)
    torch.testing.assert_close(shaped, shaped_ref, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(adv.double(), adv_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_scope", ["batch", "group"])
@pytest.mark.parametrize("std", ["population", "unbiased"])
def test_a1_t2_closed_form_at_alpha2_zero(weight_scope, std):
    """alpha2 = 0: +sqrt((1-p)/p) on correct tokens, -sqrt(p/(1-p)) on incorrect ones, p = correct-token share."""
    ent, mask, r, gid, ng = token_batch([5, 2, 4, 1, 3, 6], [1, -1, -1, 1, 1, -1], list("aabbcc"), L=6)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, GTPOParams(alpha2=0.0, weight_scope=weight_scope, std=std))
    m = mask.bool()
    pos, neg = m & (r > 0)[:, None], m & (r <= 0)[:, None]
    n, n_pos = int(m.sum()), int(pos.sum())
    p = n_pos / n
    bessel = math.sqrt((n - 1) / n) if std == "unbiased" else 1.0  # unbiased std is sqrt(n/(n-1)) larger
    torch.testing.assert_close(adv[pos], torch.full_like(adv[pos], math.sqrt((1 - p) / p) * bessel), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv[neg], torch.full_like(adv[neg], -math.sqrt(p / (1 - p)) * bessel), atol=1e-5, rtol=0)
    joint, _ = gtpo_token_advantages(ent, mask, r, gid, ng, GTPOParams(alpha2=0.0, norm_mode="joint", std=std))
    torch.testing.assert_close(adv, joint, atol=1e-5, rtol=0)
    assert torch.count_nonzero(adv[~m]) == 0


def test_a1_t2_uniform_entropy_is_token_level_grpo():
    ent, mask, r, gid, ng = token_batch([5, 2, 4, 1, 3], [1, -1, -1, 1, 1], list("aabbb"))
    ent = torch.where(mask.bool(), torch.full_like(ent, 1.3), ent)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, GTPOParams(std="population"))
    m = mask.bool()
    p = float((m & (r > 0)[:, None]).sum()) / float(m.sum())
    expected = torch.where(r > 0, math.sqrt((1 - p) / p), -math.sqrt(p / (1 - p))).float()[:, None] * mask
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("norm_scope", ["batch", "group"])
def test_a1_t11_sign_of_correctness(seed, norm_scope):
    """Remark 2.5: every valid token of a correct response has A > 0, of an incorrect one A < 0 (split: not so)."""
    ent, mask, r, gid, ng = random_token_batch(300 + seed, allow_empty=False)
    keep = torch.zeros(ng, 2, dtype=torch.bool)
    keep[gid, (r > 0).long()] = True
    mixed_group = keep.all(-1)[gid]
    rows = mixed_group if norm_scope == "group" else torch.ones_like(mixed_group)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, GTPOParams(norm_scope=norm_scope))
    m = mask.bool() & rows[:, None]
    assert bool((adv[m & (r > 0)[:, None]] > 0).all())
    assert bool((adv[m & (r <= 0)[:, None]] < 0).all())
    split, _ = gtpo_token_advantages(ent, mask, r, gid, ng, GTPOParams(norm_mode="split", norm_scope=norm_scope))
    assert bool((split[m & (r > 0)[:, None]] < 0).any())  # split has no sign of correctness


def test_alpha_dependence_unlike_split():
    ent, mask, r, gid, ng = random_token_batch(8)
    advs = [gtpo_token_advantages(ent, mask, r, gid, ng, GTPOParams(alpha1=a1, alpha2=a2))[0] for a1, a2 in
            [(1.0, 0.1), (1.0, 0.2), (0.9, 0.1)]]  # fmt: skip
    assert (advs[0] - advs[1]).abs().max() > 1e-3
    assert (advs[0] - advs[2]).abs().max() > 1e-3
    splits = [gtpo_token_advantages(ent, mask, r, gid, ng, GTPOParams(alpha1=a1, alpha2=a2, norm_mode="split"))[0]
              for a1, a2 in [(1.0, 0.1), (1.0, 0.2), (0.9, 0.1)]]  # fmt: skip
    torch.testing.assert_close(splits[0], splits[1], atol=1e-4, rtol=0)
    torch.testing.assert_close(splits[0], splits[2], atol=1e-4, rtol=0)


def test_a1_t12_batch_weight_scope_ignores_group_membership():
    """§4: moving a correct response into another prompt's group leaves its shaped rewards unchanged (batch)."""
    ent, mask, r, gid, ng = token_batch([4, 3, 4, 2, 4, 3], [1, 1, -1, 1, -1, 1], list("aaabbb"), seed=12)
    moved = gid.clone()
    moved[0] = gid[3]  # row 0 (correct) joins the other prompt's group
    for scope, same in (("batch", True), ("group", False)):
        p = GTPOParams(weight_scope=scope)
        before = gtpo_shaped_rewards(ent, mask, r, gid, ng, p)
        after = gtpo_shaped_rewards(ent, mask, r, moved, ng, p)
        assert torch.equal(before[0], after[0]) is same
    # under batch scope the advantages do not move either (the whitening is batch-wide too)
    a0, _ = gtpo_token_advantages(ent, mask, r, gid, ng)
    a1, _ = gtpo_token_advantages(ent, mask, r, moved, ng)
    torch.testing.assert_close(a0, a1, atol=1e-6, rtol=0)


def test_one_polarity_scope_keeps_entropy_rank():
    ent, mask, r, gid, ng = token_batch([3, 3, 3], [1, 1, 1], ["a"] * 3, seed=2)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng)
    for t in range(3):
        assert torch.equal(torch.argsort(adv[:, t]), torch.argsort(ent[:, t]))


@pytest.mark.parametrize("norm_mode", ["zero_fill", "joint", "split"])
@pytest.mark.parametrize("norm_scope", ["batch", "group"])
@pytest.mark.parametrize("weight_scope", ["batch", "group"])
def test_diagnostics_in_every_mode(norm_mode, norm_scope, weight_scope):
    ent, mask, r, gid, ng = random_token_batch(21)
    p = GTPOParams(norm_mode=norm_mode, norm_scope=norm_scope, weight_scope=weight_scope)
    adv, diag = gtpo_token_advantages(ent, mask, r, gid, ng, p)
    _, ref_diag = gtpo_token_definition(ent, mask, r, gid, ng, p)
    assert set(diag) == set(ref_diag)
    assert all(isinstance(v, float) and math.isfinite(v) for v in diag.values())
    assert abs(diag["weight_pos_mean"] - 1.0) < 1e-5 and abs(diag["weight_neg_mean"] - 1.0) < 1e-5
    for key in ("adv_correct_mean", "adv_incorrect_mean", "adv_abs_mean", "conservation_err", "shaped_correct_mean"):
        assert diag[key] == pytest.approx(ref_diag[key], rel=1e-3, abs=1e-5), key


# ---------------------------------------------------------------------------------------------------------------------
# mutation gaps


@pytest.mark.parametrize("norm_mode", ["zero_fill", "joint", "split"])
@pytest.mark.parametrize("norm_scope", ["batch", "group"])
@pytest.mark.parametrize("seed", range(12))
def test_kernel_large_zero_var_rtol_and_negative_correct_base(norm_mode, norm_scope, seed):
    """A correct row whose base is negative (offset below -r) has shaped rewards of both signs: mean|x| needs them
    token by token, and a large ``zero_var_rtol`` makes the constant-set decision depend on it."""
    gen = torch.Generator().manual_seed(seed)
    ent, mask, r, gid, ng = random_token_batch(400 + seed, allow_empty=True)
    r = torch.where(r > 0, 0.3, -1.0)
    offset = torch.where(torch.rand(len(r), generator=gen) < 0.7, -1.0, 0.0)  # correct base 0.3 - 1 < 0
    p = GTPOParams(norm_mode=norm_mode, norm_scope=norm_scope, alpha2=1.0, zero_var_rtol=0.1 + 0.075 * seed)
    fast, _ = gtpo_token_advantages(ent, mask, r, gid, ng, p, reward_offset=offset)
    ref, _ = gtpo_token_definition(ent, mask, r, gid, ng, p, reward_offset=offset)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scope", ["batch", "group"])  # closed-form statistics / per-row statistics
def test_constant_set_decision_uses_token_level_abs_for_mixed_sign_rows(scope):
    """rtol between std / mean|x| and std / (sum_rows |sum x| / n) of the correct set: the set is constant
    (advantage 0) only if mean|x| is taken token by token, as the rows' shaped rewards have both signs."""
    ent, mask, _, gid, ng = token_batch([4, 3, 4, 2, 3], [1, 1, 1, -1, -1], ["g"] * 5, seed=5)
    r = torch.tensor([0.3, 0.3, 0.3, -1.0, -1.0])
    offset = torch.tensor([-0.35, -0.35, -0.35, 0.0, 0.0])  # correct base -0.05: -0.05 + a2 * w, both signs
    p = GTPOParams(norm_mode="split", alpha2=0.3, norm_scope=scope, weight_scope=scope)
    shaped = gtpo_shaped_rewards(ent, mask, r, gid, ng, p, reward_offset=offset)
    m = mask.bool()
    sel = m & (r > 0)[:, None]
    x = shaped[sel]
    assert bool((x < 0).any()) and bool((x > 0).any())  # signs really are mixed
    abs_tok = float(x.abs().mean())
    abs_row = float(torch.where(sel, shaped, 0.0).sum(-1).abs().sum()) / x.numel()
    std = float(x.std())
    rtol = 0.5 * (std / abs_tok + std / abs_row)
    assert std / abs_tok < rtol < std / abs_row < 1
    p = GTPOParams(norm_mode="split", alpha2=0.3, zero_var_rtol=rtol, norm_scope=scope, weight_scope=scope)
    fast, _ = gtpo_token_advantages(ent, mask, r, gid, ng, p, reward_offset=offset)
    ref, _ = gtpo_token_definition(ent, mask, r, gid, ng, p, reward_offset=offset)
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)
    assert torch.count_nonzero(fast[sel]) == 0


@pytest.mark.parametrize("scope", ["batch", "group"])
def test_near_constant_set_is_measured_not_cancelled(scope):
    """Uniform entropy in an all-correct batch: the split set differs only by the eps guards (~a2*eps/H), so it is
    constant under the default tolerance and only rounding-sized without it (both statistics of the kernel)."""
    ent, mask, r, gid, ng = token_batch([4, 2, 3, 1, 4], [1, 1, 1, 1, 1], list("aabbb"), L=4)
    ent = torch.where(mask.bool(), torch.full_like(ent, 0.01), ent)
    kw = dict(norm_mode="split", norm_scope=scope, weight_scope=scope)
    adv, _ = gtpo_token_advantages(ent, mask, r, gid, ng, GTPOParams(**kw))
    assert torch.count_nonzero(adv) == 0
    raw, _ = gtpo_token_advantages(ent, mask, r, gid, ng, GTPOParams(zero_var_rtol=0.0, **kw))
    ref, _ = gtpo_token_definition(ent, mask, r, gid, ng, GTPOParams(zero_var_rtol=0.0, **kw))
    assert raw.abs().max() > 0.1  # rounding-sized spreads turned into sizeable advantages without the tolerance
    torch.testing.assert_close(raw, ref, atol=2e-2, rtol=0)
