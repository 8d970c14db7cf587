"""GTPO-trajectory (arXiv 2508.03772): conflict tokens, entropy filter/penalty, variants, verl loss mapping.

Run: cd /work/main && .venv/bin/pytest -q tests/test_trajectory.py

Claims B-T1..B-T7 of docs/ALGORITHMS.md §8.3; conflict detection against a slow loop transcription of §6.2.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from gtpo.algorithms.conflict_tokens import Runs, conflict_runs, conflict_weights
from gtpo.algorithms.gtpo_traj import LN2, GTPOTrajParams, centred_advantages, entropy_filter, trajectory
from tests.support.estimators import random_traj_batch, response_mask

A, B, C, D, X = 11, 12, 13, 14, 15


def _rows(seqs, pad=0):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, response_mask([len(s) for s in seqs], width)


def _cw(seqs, gid, pol, lam_pos=2.0, lam_neg=0.0):
    ids, m = _rows(seqs)
    gid_t = torch.tensor(gid)
    return conflict_weights(ids, m, gid_t, int(gid_t.max()) + 1, torch.tensor(pol, dtype=torch.int8), lam_pos, lam_neg)


# ----------------------------------------------------------------------------------------------- B-T3 definition


def test_worked_example_forward_and_backward_runs():
    lam, conf = _cw([[A, B, C, X], [A, B, D, X]], [0, 0], [1, -1])
    assert conf.tolist() == [[True, True, False, True], [True, True, False, True]]
    assert lam.tolist() == [[2.0, 2.0, 1.0, 2.0], [0.0, 0.0, 1.0, 0.0]]


def test_middle_match_after_mismatch_is_not_a_conflict():
    # B matches at position 2, between mismatches at positions 1 and 3; X matches at the end (trailing run).
    lam, conf = _cw([[A, C, B, C, X], [A, D, B, D, X]], [0, 0], [1, -1])
    assert conf.tolist() == [[True, False, False, False, True], [True, False, False, False, True]]


def test_backward_run_is_right_aligned():
    # Different lengths: suffix "B X" shared from the end, prefix not shared.
    lam, conf = _cw([[C, C, B, X], [D, B, X]], [0, 0], [1, -1])
    assert conf.tolist() == [[False, False, True, True], [False, True, True, False]]
    assert lam[1].tolist() == [1.0, 0.0, 0.0, 0.0]  # padding weight 0


def test_inactive_rows_and_one_sided_groups_have_no_conflicts():
    # Row 2 (A_i = 0) shares every token but is never a conflict and keeps lambda = 1.
    lam, conf = _cw([[A, B, C], [A, B, D], [A, B, C]], [0, 0, 0], [1, -1, 0])
    assert not conf[2].any() and lam[2].tolist() == [1.0, 1.0, 1.0]
    # An inactive row does not make a token shared: group of one positive + one inactive -> nothing.
    lam, conf = _cw([[A, B], [A, B]], [0, 0], [1, 0])
    assert not conf.any() and lam.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    # Only positives / only negatives.
    for pol in ([1, 1], [-1, -1]):
        lam, conf = _cw([[A, B], [A, B]], [0, 0], pol)
        assert not conf.any()
    # Tokens shared only across groups are not conflicts.
    lam, conf = _cw([[A, B], [A, B]], [0, 1], [1, -1])
    assert not conf.any()


def test_token_in_both_runs_gets_lambda_squared():
    lam, conf = _cw([[A, B], [A, B]], [0, 0], [1, -1])
    assert lam.tolist() == [[4.0, 4.0], [0.0, 0.0]]
    ids, m = _rows([[A, B], [A, B]])
    polarity = torch.tensor([1, -1], dtype=torch.int8)
    runs = conflict_runs(ids, m, torch.tensor([0, 0]), 1, polarity)
    assert runs.fwd.tolist() == [2, 2] and runs.bwd.tolist() == [2, 2] and runs.overlap().tolist() == [2, 2]
    assert runs.n_conf(polarity, "union").tolist() == [2, 2] and runs.n_conf(polarity, "official").tolist() == [2, 2]


def test_conflict_counts_clamp_and_inactive():
    # no conflict -> 1; one of two tokens -> 1; both -> 2 but the row is inactive -> 1
    runs = Runs(torch.tensor([0, 1, 2]), torch.tensor([0, 0, 2]), torch.tensor([1, 1, 1]))
    assert runs.n_conf(torch.tensor([1, -1, 0], dtype=torch.int8)).tolist() == [1, 1, 1]


def test_bad_inputs_raise():
    ids, m = _rows([[A, B]])
    with pytest.raises(ValueError, match="polarity"):
        conflict_weights(ids, m, torch.tensor([0]), 1, torch.tensor([2], dtype=torch.int8))
    with pytest.raises(ValueError, match="gid"):
        conflict_weights(ids, m, torch.tensor([3]), 1, torch.tensor([1], dtype=torch.int8))
    with pytest.raises(ValueError, match="integer"):
        conflict_weights(ids.float(), m, torch.tensor([0]), 1, torch.tensor([1], dtype=torch.int8))


# --------------------------------------------------------------------------------- loop reference, random groups


def _slow_reference(ids, mask, gid, pol, lam_pos, lam_neg):
    """Direct transcription of §6.2 with Python loops (a masked position inside a row ends its run)."""
    bsz, width = ids.shape
    lam = mask.float().clone()
    conf = torch.zeros(bsz, width, dtype=torch.bool)
    last = [max([t for t in range(width) if mask[i, t]], default=-1) for i in range(bsz)]

    def col(i, d, rev):
        return last[i] - d if rev else d

    def shared(i, d, rev):
        t = col(i, d, rev)
        if t < 0 or t >= width or not mask[i, t]:
            return False
        has_p = has_n = False
        for k in range(bsz):
            if gid[k] != gid[i] or pol[k] == 0:
                continue
            tk = col(k, d, rev)
            if 0 <= tk < width and mask[k, tk] and ids[k, tk] == ids[i, t]:
                has_p |= pol[k] > 0
                has_n |= pol[k] < 0
        return has_p and has_n

    for i in range(bsz):
        if pol[i] == 0:
            continue
        w = lam_pos if pol[i] > 0 else lam_neg
        for rev in (False, True):
            for d in range(width):
                if not shared(i, d, rev):
                    break
                t = col(i, d, rev)
                conf[i, t] = True
                lam[i, t] *= w
    return lam, conf


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_matches_loop_reference(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for _ in range(60):
        num_groups = rng.randint(1, 4)
        sizes = [rng.randint(1, 5) for _ in range(num_groups)]  # unequal group sizes
        gid = torch.tensor([g for g, s in enumerate(sizes) for _ in range(s)])
        gid = gid[torch.randperm(len(gid))]  # shuffled rows
        bsz, width, vocab = len(gid), rng.randint(1, 9), rng.randint(1, 3)  # tiny vocab: many coincidences
        lengths = torch.randint(0, width + 1, (bsz,))
        mask = response_mask(lengths, width)
        if rng.random() < 0.3:  # holes inside responses (multi-turn tool tokens)
            mask = mask * (torch.rand(bsz, width) > 0.2).long()
        ids = torch.randint(0, vocab, (bsz, width))
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, 99))
        pol = torch.randint(-1, 2, (bsz,)).to(torch.int8)
        lam, conf = conflict_weights(
            ids, mask, gid, num_groups, pol, 2.0, 0.5, first_block=rng.randint(1, 3), max_block=rng.randint(3, 5)
        )
        ref_lam, ref_conf = _slow_reference(ids, mask, gid, pol, 2.0, 0.5)
        assert torch.equal(conf, ref_conf)
        assert torch.allclose(lam, ref_lam)


def test_padding_token_values_are_ignored():
    ids, m = _rows([[A, B, C], [A, B]])
    pol = torch.tensor([1, -1], dtype=torch.int8)
    lam1, conf1 = conflict_weights(ids, m, torch.tensor([0, 0]), 1, pol)
    ids2 = ids.clone()
    ids2[1, 2] = C  # the pad slot holds the positive row's token: must not create a conflict
    lam2, conf2 = conflict_weights(ids2, m, torch.tensor([0, 0]), 1, pol)
    assert torch.equal(conf1, conf2) and torch.equal(lam1, lam2)
    assert not conf1[:, 2].any()


# ----------------------------------------------------------------------------------------------- params / variants


def test_variant_defaults_and_overrides():
    p = GTPOTrajParams()
    assert (p.variant, p.adv_norm, p.use_ini_gate, p.tau, p.divide_by_nconf, p.agg, p.skip_zero_adv_groups) == (
        "paper",
        "std",
        True,
        LN2,
        False,
        "paper_mean",
        True,
    )
    c = GTPOTrajParams(variant="code")
    assert (c.adv_norm, c.use_ini_gate, c.tau, c.divide_by_nconf, c.agg, c.skip_zero_adv_groups) == (
        "none",
        False,
        0.7,
        True,
        "code_sum",
        False,
    )
    assert (p.lam_pos, p.lam_neg, p.gamma) == (2.0, 0.0, 0.1)
    o = GTPOTrajParams(variant="code", tau=1.02, divide_by_nconf=False)
    assert o.tau == 1.02 and o.divide_by_nconf is False and o.agg == "code_sum"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"variant": "both"}, "variant"),
        ({"lam_pos": -1}, "lam_pos"),
        ({"gamma": float("nan")}, "gamma"),
        ({"tau": -0.1}, "tau"),
        ({"adv_norm": "mad"}, "adv_norm"),
        ({"agg": "sum"}, "agg"),
        ({"h_ini": -1.0}, "h_ini"),
        ({"divide_by_nconf": "yes"}, "divide_by_nconf"),
    ],
)
def test_params_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GTPOTrajParams(**kwargs)


def test_load_knobs_names_the_key():
    from gtpo.methods import knob

    with pytest.raises(ValueError, match=r"algorithm\.gtpo_traj\.lam_neg=-2"):
        knob({"gtpo_traj": {"lam_neg": -2}}, "gtpo_traj")
    with pytest.raises(ValueError, match="unknown"):
        knob({"gtpo_traj": {"lambda_pos": 2}}, "gtpo_traj")
    assert knob({"gtpo_traj": {"variant": "code"}}, "gtpo_traj").agg == "code_sum"
    assert knob({}, "gtpo_traj").variant == "paper"


# ------------------------------------------------------------------------------------------- helpers for verl loss


def _actor_config(loss_agg_mode):
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(
        strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=2, loss_agg_mode=loss_agg_mode
    )


def _verl_grad(advantages, mask, loss_agg_mode):
    """Gradient of verl's vanilla PPO loss w.r.t. log-probs at ratio 1 (on-policy)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    cfg = _actor_config(loss_agg_mode)
    old = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    logp = old.clone().requires_grad_(True)
    loss, _ = get_policy_loss_fn("vanilla")(
        old_log_prob=old,
        log_prob=logp,
        advantages=advantages,
        response_mask=mask.bool(),
        loss_agg_mode=loss_agg_mode,
        config=cfg,
    )
    loss.backward()
    return loss.detach(), logp.grad


def _example_batch():
    # Two groups in shuffled row order, unequal sizes; group 0 has the worked example.
    seqs = [[A, B, C, X], [C, A], [A, B, D, X], [A, D, D, D, X], [B, A], [C, C, C]]
    gid = torch.tensor([0, 1, 0, 0, 1, 1])
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    ids, m = _rows(seqs)
    return ids, m, gid, scores


def _params(**kw):
    base = dict(
        lam_pos=1.0,
        lam_neg=1.0,
        gamma=0.0,
        tau=math.inf,
        divide_by_nconf=False,
        adv_norm="none",
        use_ini_gate=False,
        skip_zero_adv_groups=False,
        agg="paper_mean",
    )
    base.update(kw)
    return GTPOTrajParams(**base)


# ------------------------------------------------------------------------------------------------ B-T4 reduction


@pytest.mark.parametrize("adv_norm, by_std", [("none", False), ("std", True)])
def test_reduction_to_on_policy_grpo(adv_norm, by_std):
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    ids, m, gid, scores = _example_batch()
    ent = torch.rand(m.shape) * 3
    out = trajectory(scores, m, ids, ent, gid, 2, _params(adv_norm=adv_norm))
    rewards = torch.zeros(m.shape)
    rewards[torch.arange(len(scores)), m.sum(-1) - 1] = scores
    index = np.array(["u0", "u1", "u0", "u0", "u1", "u1"], dtype=object)
    ref, _ = compute_grpo_outcome_advantage(rewards, m.float(), index, norm_adv_by_std_in_grpo=by_std)
    torch.testing.assert_close(out.advantages, ref.float(), rtol=1e-5, atol=1e-6)

    # Loss and gradient through verl's vanilla loss with seq-mean-token-mean: dL/dlogp = -A_i / |o_i| / B.
    loss, grad = _verl_grad(out.advantages, m, "seq-mean-token-mean")
    lengths = m.sum(-1, keepdim=True).float()
    expected = -(out.adv_seq[:, None] / lengths / len(scores)) * m
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss, -(out.adv_seq.mean()), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------- B-T1 / B-T2 grads


def test_gradient_zero_on_negative_conflicts_and_lambda_on_positive():
    ids, m, gid, scores = _example_batch()
    ent = torch.zeros(m.shape)
    out = trajectory(scores, m, ids, ent, gid, 2, _params(lam_pos=2.0, lam_neg=0.0))
    _, grad = _verl_grad(out.advantages, m, "seq-mean-token-mean")
    conf = out.is_conflict
    neg = out.polarity < 0
    pos = out.polarity > 0
    assert conf[neg].any() and conf[pos].any()
    # B-T1: exactly zero gradient on the negative completions' conflict tokens.
    assert torch.all(grad[neg][conf[neg]] == 0)
    # B-T2: positive row 0 = "A B C X": forward {A, B}, backward {X}; C is not a conflict.
    g0 = grad[0]
    assert conf[0, :4].tolist() == [True, True, False, True]
    torch.testing.assert_close(g0[0], 2 * g0[2])
    torch.testing.assert_close(g0[1], 2 * g0[2])
    torch.testing.assert_close(g0[3], 2 * g0[2])
    assert g0[2] < 0  # descent increases log-prob of a positive completion


def test_gradient_four_times_when_in_both_runs():
    # Group 0: row 0 positive, rows 1 and 2 negative. Group 1: rows 3 and 5 positive, row 4 negative.
    ids, m = _rows([[A, B, C], [A, B, D], [A, X, X], [A, A], [A, A], [C, D, X]])
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    out = trajectory(scores, m, ids, torch.zeros(m.shape), gid, 2, _params(lam_pos=2.0, lam_neg=0.0))
    _, grad = _verl_grad(out.advantages, m, "seq-mean-token-mean")
    # Row 3 "A A" (positive) equals row 4 (negative): every token in both runs -> lambda 4.
    assert out.lam[3, :2].tolist() == [4.0, 4.0]
    # Compare with the same row without conflicts: a copy with lam=1 (lam_pos=1) gives a quarter of the gradient.
    out1 = trajectory(scores, m, ids, torch.zeros(m.shape), gid, 2, _params(lam_pos=1.0, lam_neg=0.0))
    _, grad1 = _verl_grad(out1.advantages, m, "seq-mean-token-mean")
    torch.testing.assert_close(grad[3, :2], 4 * grad1[3, :2])
    assert torch.all(grad[4] == 0)


def test_lambda_neg_zeroes_advantage_but_keeps_token_in_denominator():
    """lambda_neg = 0 is applied through the advantages: the token stays in every loss denominator."""
    ids, m, gid, scores = _example_batch()
    out = trajectory(scores, m, ids, torch.zeros(m.shape), gid, 2, _params(lam_pos=1.0, lam_neg=0.0))
    row = 2  # negative "A B D X": conflicts at A, B, X; D is not a conflict
    assert out.is_conflict[row].tolist() == [True, True, False, True, False]
    for mode, denom in (("seq-mean-token-mean", 4.0 * len(scores)), ("token-mean", float(m.sum()))):
        _, grad = _verl_grad(out.advantages, m, mode)
        # Zeroing: the surviving token's gradient is divided by the full count (4 tokens / all batch tokens) ...
        torch.testing.assert_close(grad[row, 2], -out.adv_seq[row] / denom)
        # ... whereas masking the 3 conflict tokens would have divided by fewer tokens.
        masked = m.clone()
        masked[row] = torch.tensor([0, 0, 1, 0, 0])
        _, grad_masked = _verl_grad(out.advantages, masked, mode)
        assert not torch.isclose(grad_masked[row, 2], grad[row, 2])


# --------------------------------------------------------------------------------------- B-T5 / B-T6 / variants


def test_entropy_filter_threshold_inclusive_and_zero_gradient():
    ids, m, gid, scores = _example_batch()
    ent = torch.full(m.shape, 0.5)
    ent[0] = 0.9  # above tau: filtered
    ent[2] = 0.7  # exactly tau: kept
    out = trajectory(scores, m, ids, ent, gid, 2, _params(tau=0.7))
    assert out.delta.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert torch.all(out.advantages[0] == 0)
    _, grad = _verl_grad(out.advantages, m, "seq-mean-token-mean")
    assert torch.all(grad[0] == 0) and torch.any(grad[2] != 0)


def test_ini_gate():
    h = torch.tensor([0.2, 0.9, 0.5])
    # Low-entropy start: filter on with tau = ln 2.
    assert entropy_filter(h, LN2, True, 0.5).tolist() == [1.0, 0.0, 1.0]
    # High-entropy start: every completion kept.
    assert entropy_filter(h, LN2, True, 1.0).tolist() == [1.0, 1.0, 1.0]
    # Gate off (code): always filtered.
    assert entropy_filter(h, 0.7, False, None).tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="h_ini"):
        entropy_filter(h, LN2, True, None)


def test_ini_gate_at_exactly_tau_filters():
    """<H>_ini == tau is the low-entropy case (the paper's delta keeps only <H>_i <= ln 2 there)."""
    h = torch.tensor([0.2, 0.9, 0.5])
    assert entropy_filter(h, 0.5, True, 0.5).tolist() == [1.0, 0.0, 1.0]
    assert entropy_filter(h, 0.5, True, math.nextafter(0.5, 1.0)).tolist() == [1.0, 1.0, 1.0]
    ids, m, gid, scores = _example_batch()
    ent = torch.full(m.shape, 0.5)
    ent[0] = 0.9
    out = trajectory(scores, m, ids, ent, gid, 2, _params(tau=0.5, use_ini_gate=True, h_ini=0.5))
    assert out.delta[0] == 0.0 and out.metrics["filter_on"] == 1.0


def test_entropy_penalty_monotone_and_zero_variance_groups():
    gid = torch.tensor([0, 0, 0, 1, 1])
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # group 0: all correct (zero variance)
    ids = torch.tensor([[A, B], [B, C], [C, D], [A, B], [C, D]])
    m = torch.ones(5, 2, dtype=torch.long)
    ent = torch.tensor([0.1, 0.3, 0.5, 0.2, 0.2])[:, None].expand(5, 2).contiguous()
    code = GTPOTrajParams(variant="code", tau=math.inf)
    out = trajectory(scores, m, ids, ent, gid, 2, code)
    # Code semantics: zero-variance group gets -gamma <H>_i (times G=3 under code_sum), strictly decreasing in H.
    shaped = out.shaped_seq[:3]
    torch.testing.assert_close(shaped, -0.1 * torch.tensor([0.1, 0.3, 0.5]) * 3)
    assert shaped[0] > shaped[1] > shaped[2] and torch.all(shaped < 0)
    paper = GTPOTrajParams(variant="paper", tau=math.inf, use_ini_gate=False)
    out_p = trajectory(scores, m, ids, ent, gid, 2, paper)
    assert torch.all(out_p.advantages[:3] == 0)
    assert torch.all(out_p.polarity[:3] == 0)


def test_centred_advantages_exact_zero_for_equal_rewards():
    gid = torch.tensor([0, 0, 0])
    adv, pol, zv = centred_advantages(torch.tensor([0.1, 0.1, 0.1]), gid, 1, "none")
    assert torch.all(adv == 0) and torch.all(pol == 0) and torch.all(zv)


def test_variants_differ_as_specified():
    """code: A = r - mean, 1/n_conf, x G (sum over completions); paper: std-normalised, no 1/n_conf, 1/G."""
    ids, m = _rows([[A, B, C, X], [A, B, D, X], [D, D]])
    gid = torch.tensor([0, 0, 0])
    scores = torch.tensor([1.0, 0.0, 0.0])
    ent = torch.zeros(m.shape)
    code_union = GTPOTrajParams(variant="code", gamma=0.0, nconf_count="union")
    code = trajectory(scores, m, ids, ent, gid, 1, code_union)
    a0 = 1.0 - 1.0 / 3.0
    # Row 0: 3 conflicts (A, B fwd; X bwd) -> n_conf 3; lambda 2 on them; x G = 3.
    torch.testing.assert_close(code.advantages[0], torch.tensor([2, 2, 1, 2]) * a0 / 3 * 3)
    assert code.n_conf.tolist() == [3, 3, 1]
    paper = trajectory(
        scores, m, ids, ent, gid, 1, GTPOTrajParams(variant="paper", gamma=0.0, use_ini_gate=False, tau=math.inf)
    )
    std = torch.tensor([1.0, 0.0, 0.0]).std()
    torch.testing.assert_close(paper.advantages[0], torch.tensor([2, 2, 1, 2]) * a0 / (std + 1e-6))
    # Row 2 "D D" (negative, no shared token with the positive row) keeps lambda 1.
    assert paper.lam[2, :2].tolist() == [1.0, 1.0]


# §6.5 worked example: rewards [1, 1, 0, 0]; (f, b) per row = (3, 2), (2, 2), (3, 2), (1, 2).
NCONF_EXAMPLE = [[1, 2, 3, 4, 5, 6], [1, 2, 7, 4, 5, 6], [1, 2, 3, 8, 5, 6], [1, 9, 9, 5, 6]]


def test_official_nconf_is_max_of_the_two_runs_worked_example():
    ids, m = _rows(NCONF_EXAMPLE)
    gid = torch.zeros(4, dtype=torch.long)
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0])
    ent = torch.zeros(m.shape)
    code = trajectory(scores, m, ids, ent, gid, 1, GTPOTrajParams(variant="code", gamma=0.0))
    assert code.n_conf.tolist() == [3, 2, 3, 2]  # max(f, b); row 0: f = 3, b = 2 -> 3
    union = trajectory(scores, m, ids, ent, gid, 1, GTPOTrajParams(variant="code", gamma=0.0, nconf_count="union"))
    assert union.n_conf.tolist() == [5, 4, 5, 3]  # f + b - overlap; row 0: 5
    # Same weights under both counts; only the divisor differs. Row 0: A = 0.5, x G = 4, / 3.
    assert torch.equal(code.lam, union.lam)
    assert code.lam[0].tolist() == [2.0, 2.0, 2.0, 1.0, 2.0, 2.0]
    torch.testing.assert_close(code.advantages[0], torch.tensor([2.0, 2, 2, 1, 2, 2]) * 0.5 * 4 / 3)
    torch.testing.assert_close(code.advantages[0] * 3, union.advantages[0] * 5)
    # The conflict-token metric counts tokens (the union) under either divisor: 5 + 4 + 5 + 3 of 23 tokens.
    assert code.metrics["conflict_token_frac"] == pytest.approx(17 / 23)


def test_nconf_count_defaults_per_variant_and_validation():
    assert GTPOTrajParams(variant="code").nconf_count == "official"
    assert GTPOTrajParams(variant="paper").nconf_count == "union"
    assert GTPOTrajParams(variant="paper", nconf_count="official").nconf_count == "official"
    assert GTPOTrajParams(variant="code", nconf_count="union").nconf_count == "union"
    with pytest.raises(ValueError, match="nconf_count='max'"):
        GTPOTrajParams(nconf_count="max")


def test_nconf_union_subtracts_the_overlap_of_the_two_runs():
    """Two identical completions of opposite polarity: both runs cover every token, n_conf = L (not 2 L)."""
    ids, m = _rows([[A, B, C], [A, B, C]])
    gid = torch.zeros(2, dtype=torch.long)
    params = GTPOTrajParams(variant="code", gamma=0.0, nconf_count="union")
    out = trajectory(torch.tensor([1.0, 0.0]), m, ids, torch.zeros(m.shape), gid, 1, params)
    assert out.is_conflict.all()
    assert out.lam.tolist() == [[4.0, 4.0, 4.0], [0.0, 0.0, 0.0]]
    assert out.n_conf.tolist() == [3, 3]
    assert out.metrics["conflict_token_frac"] == 1.0
    # lambda summed over the positive row: 4 per token (both runs), 3 tokens; x |A| = 0.5, x G = 2, / n_conf = 3.
    assert out.metrics["adv_abs_mean"] == pytest.approx(4 * 3 * 0.5 * 2 / 3 / 6)


def test_lambda_flags_follow_unshaped_sign():
    """A positive completion whose shaped advantage turned negative keeps lambda_pos on its conflict tokens."""
    ids, m = _rows([[A, B, C], [A, B, D]])
    gid = torch.tensor([0, 0])
    ent = torch.tensor([[9.0, 9.0, 9.0], [0.0, 0.0, 0.0]])
    out = trajectory(torch.tensor([1.0, 0.0]), m, ids, ent, gid, 1, _params(lam_pos=2.0, lam_neg=0.0, gamma=1.0))
    assert out.shaped_seq[0] < 0 and out.lam[0].tolist() == [2.0, 2.0, 1.0]


# --------------------------------------------------------------------------------------------------- B-T7 sanity


def test_ln2_threshold_sanity():
    from verl.utils.torch_functional import entropy_from_logits

    for k in (2, 3, 10):
        logits = torch.zeros(1, 50)
        logits[0, k:] = -1e9
        assert entropy_from_logits(logits).item() >= LN2 - 1e-6
    one_hot = torch.full((1, 50), -1e9)
    one_hot[0, 3] = 0.0
    assert abs(entropy_from_logits(one_hot).item()) < 1e-6


# ------------------------------------------------------------------------------------------------------- adapter


def _adapter_inputs():
    ids, m, gid, scores = _example_batch()
    rewards = torch.zeros(m.shape)
    rewards[torch.arange(len(scores)), m.sum(-1) - 1] = scores
    index = np.array(["u0", "u1", "u0", "u0", "u1", "u1"], dtype=object)
    return rewards, m, index, ids


def test_adapter_registered_and_validates_inputs():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from gtpo.verl_plugin.estimators import VerlEstimator

    fn = get_adv_estimator_fn("gtpo_traj")
    assert isinstance(fn, VerlEstimator) and fn.method.name == "gtpo_traj"
    rewards, m, index, ids = _adapter_inputs()
    with pytest.raises(ValueError, match="entropy"):
        fn(token_level_rewards=rewards, response_mask=m, index=index, config={}, responses=ids)
    with pytest.raises(ValueError, match="responses"):
        fn(token_level_rewards=rewards, response_mask=m, index=index, config={}, entropy=torch.zeros(m.shape))


def test_adapter_measures_h_ini_once_and_refuses_unmeasured_resume():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    rewards, m, index, ids = _adapter_inputs()
    cfg = OmegaConf.create({"adv_estimator": "gtpo_traj", "gtpo_traj": {"variant": "paper"}})
    state = {"h_ini": None}  # the trainer's gtpo_traj block
    ent = torch.full(m.shape, 0.3)
    metrics = {}
    adv, ret = get_adv_estimator_fn("gtpo_traj")(
        token_level_rewards=rewards,
        response_mask=m,
        index=index,
        config=cfg,
        entropy=ent,
        responses=ids,
        metrics=metrics,
        global_steps=1,
        state=state,
    )
    assert state == {"h_ini": pytest.approx(0.3)}
    for key in ("gtpo_traj/conflict_token_frac", "gtpo_traj/filtered_traj_frac", "gtpo_traj/h_ini"):
        assert key in metrics and isinstance(metrics[key], float)
    assert torch.all(adv[m == 0] == 0) and torch.equal(adv, ret)
    # A later batch with higher entropy does not re-measure: the gate uses the value in the state.
    metrics = {}
    get_adv_estimator_fn("gtpo_traj")(
        token_level_rewards=rewards,
        response_mask=m,
        index=index,
        config=cfg,
        entropy=ent * 5,
        responses=ids,
        metrics=metrics,
        state=state,
    )
    assert state == {"h_ini": pytest.approx(0.3)} and metrics["gtpo_traj/h_ini"] == pytest.approx(0.3)
    # Without a state a call measures its own batch and keeps nothing.
    metrics = {}
    get_adv_estimator_fn("gtpo_traj")(
        token_level_rewards=rewards, response_mask=m, index=index, config=cfg, entropy=ent * 5, responses=ids,
        metrics=metrics,
    )  # fmt: skip
    assert metrics["gtpo_traj/h_ini"] == pytest.approx(1.5) and state == {"h_ini": pytest.approx(0.3)}
    with pytest.raises(ValueError, match="resumed"):
        get_adv_estimator_fn("gtpo_traj")(
            token_level_rewards=rewards,
            response_mask=m,
            index=index,
            config=cfg,
            entropy=ent,
            responses=ids,
            global_steps=7,
            state={"h_ini": None},
        )
    # An explicit h_ini needs no measurement.
    cfg2 = OmegaConf.create({"gtpo_traj": {"h_ini": 1.5}})
    metrics = {}
    get_adv_estimator_fn("gtpo_traj")(
        token_level_rewards=rewards,
        response_mask=m,
        index=index,
        config=cfg2,
        entropy=ent,
        responses=ids,
        metrics=metrics,
        global_steps=7,
    )
    assert metrics["gtpo_traj/h_ini"] == 1.5 and metrics["gtpo_traj/filter_on"] == 0.0


def test_adapter_row_order_invariance():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    rewards, m, index, ids = _adapter_inputs()
    cfg = OmegaConf.create({"gtpo_traj": {"variant": "code"}})
    ent = torch.rand(m.shape, generator=torch.Generator().manual_seed(3)) * 0.5
    adv, _ = get_adv_estimator_fn("gtpo_traj")(
        token_level_rewards=rewards, response_mask=m, index=index, config=cfg, entropy=ent, responses=ids
    )
    perm = torch.tensor([3, 5, 0, 4, 2, 1])
    adv_p, _ = get_adv_estimator_fn("gtpo_traj")(
        token_level_rewards=rewards[perm],
        response_mask=m[perm],
        index=index[perm.numpy()],
        config=cfg,
        entropy=ent[perm],
        responses=ids[perm],
    )
    torch.testing.assert_close(adv_p, adv[perm])


# ------------------------------------------------------------------------- the compiled kernel vs the definition


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("variant", ["paper", "code"])
def test_kernel_matches_definition(seed, variant):
    from gtpo.algorithms.gtpo_traj import gtpo_traj_definition

    scores, mask, ids, ent, gid, ng = random_traj_batch(seed)
    overrides = {"nconf_count": "union"} if seed % 2 else {"skip_zero_adv_groups": not (variant == "paper")}
    params = GTPOTrajParams(variant=variant, tau=0.6 if seed % 4 else math.inf, lam_neg=0.5 * (seed % 3), **overrides)
    h_ini = 0.5 if seed % 4 == 1 else None
    out = trajectory(scores, mask, ids, ent, gid, ng, params, h_ini, measure_h_ini=True)
    adv, pol, zv = centred_advantages(scores, gid, ng, params.adv_norm, params.eps)
    ref = gtpo_traj_definition(mask, ids, ent, gid, ng, params, adv, pol, zv, h_ini or out.h_ini)
    torch.testing.assert_close(out.advantages, ref.advantages, rtol=1e-6, atol=1e-7)
    for name in ("shaped_seq", "mean_entropy", "delta", "n_conf", "lam", "is_conflict"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), msg=name)
    for name in ("fwd", "bwd", "last"):
        torch.testing.assert_close(getattr(out.runs, name), getattr(ref.runs, name), msg=name)
    assert out.h_ini == pytest.approx(ref.h_ini)
    metrics = {k: v for k, v in out.metrics.items() if k != "kernel_compile_s"}
    assert set(metrics) == set(ref.metrics)
    for key, value in ref.metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_kernel_conflict_runs_match_the_loop_reference():
    """The kernel's conflict runs against the slow transcription of §6.2 (holes in the masks, unequal groups)."""
    for trial in range(40):
        scores, mask, ids, ent, gid, ng = random_traj_batch(100 + trial)
        params = _params(lam_pos=2.0, lam_neg=0.5)
        out = trajectory(scores, mask, ids, ent, gid, ng, params)
        ref_lam, ref_conf = _slow_reference(ids, mask, gid, out.polarity, 2.0, 0.5)
        assert torch.equal(out.is_conflict, ref_conf), trial
        assert torch.allclose(out.lam, ref_lam), trial


@pytest.mark.parametrize("kernel", [True, False])
def test_nan_entropy_on_a_valid_token_raises(monkeypatch, kernel):
    from gtpo.algorithms import kernel_dispatch

    if not kernel:  # numba missing: the definition runs, with the same check
        monkeypatch.setattr(kernel_dispatch, "_OFF", {"gtpo_traj"})
    ids, m, gid, scores = _example_batch()
    ent = torch.where(m.bool(), torch.rand(m.shape), float("nan"))  # NaN padding is fine
    trajectory(scores, m, ids, ent, gid, 2, _params())
    ent[2, 1] = float("nan")
    with pytest.raises(ValueError, match="entropy holds NaN on 1 valid token"):
        trajectory(scores, m, ids, ent, gid, 2, _params())


def test_ini_gate_without_h_ini_needs_a_measurement():
    ids, m, gid, scores = _example_batch()
    with pytest.raises(ValueError, match="h_ini=None"):
        trajectory(scores, m, ids, torch.rand(m.shape), gid, 2, GTPOTrajParams())
    out = trajectory(scores, m, ids, torch.full(m.shape, 0.25), gid, 2, GTPOTrajParams(), measure_h_ini=True)
    assert out.h_ini == pytest.approx(0.25) and out.metrics["h_ini"] == pytest.approx(0.25)
