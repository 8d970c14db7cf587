"""verl adapters of GTPO / GRPO-S / GROP: registries, knobs, metrics, the registered grpo_s loss, the method presets.

No Ray is started. The loss is called with the actor config built as verl's worker builds it
(``omega_conf_to_dataclass`` on the composed ``actor_rollout_ref.actor`` node) and ``global_batch_info`` filled as
``verl.workers.utils.losses.ppo_loss`` does.

Run: cd /work/main && .venv/bin/pytest -q tests/test_entropy_shaping_verl.py
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn

import gtpo.verl_plugin.register  # noqa: F401  (the recipe's rows in verl's registries)
from gtpo.algorithms.group_ops import group_ids
from gtpo.algorithms.grpo_s import GRPOSParams, grpo_s_advantages
from gtpo.algorithms.gtpo_token import GTPOParams, gtpo_token_advantages
from gtpo.algorithms.length_penalty import grop_penalty
from gtpo.methods import METHODS
from gtpo.verl_plugin import estimators

compute_gtpo_advantage = get_adv_estimator_fn("gtpo")
compute_grpo_s_advantage = get_adv_estimator_fn("grpo_s")
compute_policy_loss_grpo_s = get_policy_loss_fn("grpo_s")

REPO = Path(__file__).resolve().parents[1]


def _verl_batch(seed=0, L=6):
    """Shuffled rows, string uids, unequal groups, score on the last valid token, NaN entropy on padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 2, 5, 3, 4, 6, 1, 5, 3]
    uids = np.array(["q7", "q2", "q7", "q9", "q2", "q7", "q9", "q2", "q7"], dtype=object)
    scores = [1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0]
    b = len(lengths)
    mask = torch.zeros(b, L)
    tlr = torch.zeros(b, L)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        tlr[i, n - 1] = scores[i]
    ent = torch.where(mask.bool(), 0.05 + 2.5 * torch.rand(b, L, generator=g), torch.full((b, L), float("nan")))
    responses = torch.randint(0, 4, (b, L), generator=g) * mask.long()
    return tlr, mask, uids, ent, responses


def _algo(**blocks):
    return OmegaConf.create({"adv_estimator": "gtpo", "gamma": 1.0, "lam": 1.0, **blocks})


# ---------------------------------------------------------------------------------------------------------------------
# registration


def test_registered_in_verl():
    """Every row with a recipe estimator is in verl's registry through the one adapter, and its policy loss too."""
    for row in METHODS.values():
        if row.advantages is not None:
            fn = get_adv_estimator_fn(row.adv_estimator)
            assert isinstance(fn, estimators.VerlEstimator) and fn.method is row
        if row.policy_loss is not None:
            assert get_policy_loss_fn(row.name).__name__ == f"compute_policy_loss_{row.name}"
    assert {r.name for r in METHODS.values() if r.advantages is not None} == {"gtpo", "grpo_s", "gtpo_traj"}


def test_import_needs_only_core_algos_and_starts_no_ray():
    import ast

    # in a fresh interpreter: another test of this worker may have started Ray
    code = "import ray, gtpo.verl_plugin.estimators; assert not ray.is_initialized()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tree = ast.parse(Path(estimators.__file__).read_text())
    verl_imports = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module.startswith("verl")
    } | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names if "verl" in a.name}
    assert verl_imports == {"verl.trainer.ppo.core_algos"}


# ---------------------------------------------------------------------------------------------------------------------
# estimators


def test_gtpo_estimator_equals_pure_function_and_writes_metrics():
    tlr, mask, uids, ent, responses = _verl_batch()
    cfg = _algo(gtpo={"alpha1": 1.0, "alpha2": 0.2, "norm_mode": "joint"})
    metrics: dict = {}
    adv, ret = compute_gtpo_advantage(
        token_level_rewards=tlr, response_mask=mask, index=uids, config=cfg, entropy=ent, metrics=metrics
    )
    gid, ng = group_ids(uids)
    expected, diag = gtpo_token_advantages(ent, mask, tlr.sum(-1), gid, ng, GTPOParams(alpha2=0.2, norm_mode="joint"))
    torch.testing.assert_close(adv, expected)
    assert ret is adv  # returns = advantages, one tensor, as verl's GRPO estimators return them
    assert adv.dtype == tlr.dtype and torch.count_nonzero(adv[~mask.bool()]) == 0
    # kernel_compile_s appears on the call that compiled (or loaded) the kernel in this process
    assert set(metrics) - {"gtpo/kernel_compile_s"} == {f"gtpo/{k}" for k in diag if k != "kernel_compile_s"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


def test_grpo_s_estimator_equals_pure_function_and_writes_metrics():
    tlr, mask, uids, ent, _ = _verl_batch(1)
    metrics: dict = {}
    adv, ret = compute_grpo_s_advantage(
        token_level_rewards=tlr,
        response_mask=mask,
        index=uids,
        config=_algo(grpo_s={"beta2": 0.3}),
        entropy=ent,
        metrics=metrics,
    )
    gid, ng = group_ids(uids)
    expected, diag = grpo_s_advantages(ent, mask, tlr.sum(-1), gid, ng, GRPOSParams(beta2=0.3))
    torch.testing.assert_close(adv, expected)
    assert torch.equal(ret, adv)
    assert set(metrics) - {"grpo_s/kernel_compile_s"} == {f"grpo_s/{k}" for k in diag if k != "kernel_compile_s"}


def test_grpo_s_estimator_beta2_zero_is_verl_grpo():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    tlr, mask, uids, ent, _ = _verl_batch(2)
    adv, _ = compute_grpo_s_advantage(tlr, mask, index=uids, config=_algo(grpo_s={"beta2": 0.0}), entropy=ent)
    expected, _ = compute_grpo_outcome_advantage(tlr, mask, uids)
    torch.testing.assert_close(adv, expected, atol=2e-5, rtol=1e-5)


def test_defaults_without_config_block():
    tlr, mask, uids, ent, _ = _verl_batch(3)
    a1, _ = compute_gtpo_advantage(tlr, mask, index=uids, config=None, entropy=ent)
    a2, _ = compute_gtpo_advantage(tlr, mask, index=uids, config=_algo(), entropy=ent)
    gid, ng = group_ids(uids)
    expected, _ = gtpo_token_advantages(ent, mask, tlr.sum(-1), gid, ng)
    assert torch.equal(a1, expected) and torch.equal(a2, expected)


def test_extra_verl_kwargs_are_accepted():
    tlr, mask, uids, ent, _ = _verl_batch(4)
    compute_gtpo_advantage(tlr, mask, index=uids, config=_algo(), entropy=ent, reward_baselines=None)


@pytest.mark.parametrize("fn", [compute_gtpo_advantage, compute_grpo_s_advantage])
def test_estimators_reject_missing_inputs(fn):
    tlr, mask, uids, ent, _ = _verl_batch()
    with pytest.raises(ValueError, match="entropy"):
        fn(tlr, mask, index=uids, config=_algo())
    with pytest.raises(ValueError, match="index"):
        fn(tlr, mask, index=None, config=_algo(), entropy=ent)
    with pytest.raises(ValueError, match="entropy shape"):
        fn(tlr, mask, index=uids, config=_algo(), entropy=ent[:, :3])
    with pytest.raises(ValueError, match="index has"):
        fn(tlr, mask, index=uids[:4], config=_algo(), entropy=ent)
    bad = torch.where(mask.bool(), ent, 0.0)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fn(tlr, mask, index=uids, config=_algo(), entropy=bad)


@pytest.mark.parametrize(
    "blocks, match",
    [
        ({"gtpo": {"alpha2": -1.0}}, r"algorithm\.gtpo\.alpha2=-1\.0"),
        ({"gtpo": {"bogus": 1}}, r"algorithm\.gtpo\.bogus"),
        ({"gtpo": {"norm_mode": "both"}}, r"algorithm\.gtpo\.norm_mode"),
        ({"grop": {"gamma1": 0.2}}, r"algorithm\.grop\.gamma1"),
    ],
)
def test_bad_knobs_name_the_key(blocks, match):
    tlr, mask, uids, ent, _ = _verl_batch()
    with pytest.raises(ValueError, match=match):
        compute_gtpo_advantage(tlr, mask, index=uids, config=_algo(**blocks), entropy=ent)


def test_bad_grpo_s_knob_names_the_key():
    tlr, mask, uids, ent, _ = _verl_batch()
    with pytest.raises(ValueError, match=r"algorithm\.grpo_s\.beta1"):
        compute_grpo_s_advantage(tlr, mask, index=uids, config=_algo(grpo_s={"beta1": -2}), entropy=ent)


@pytest.mark.parametrize("name", ["gtpo", "grpo_s"])
def test_grop_enabled_adds_penalty_to_the_base(name):
    tlr, mask, uids, ent, _ = _verl_batch(5)
    fn = compute_gtpo_advantage if name == "gtpo" else compute_grpo_s_advantage
    metrics: dict = {}
    adv, _ = fn(tlr, mask, index=uids, config=_algo(grop={"enable": True}), entropy=ent, metrics=metrics)
    gid, ng = group_ids(uids)
    r = tlr.sum(-1)
    pen = grop_penalty(mask.sum(-1), r > 0, gid, ng, 0.75)
    assert bool((pen < 0).any())
    if name == "gtpo":
        expected, _ = gtpo_token_advantages(ent, mask, r, gid, ng, GTPOParams(), reward_offset=pen)
    else:
        expected, _ = grpo_s_advantages(ent, mask, r, gid, ng, GRPOSParams(), reward_offset=pen)
    torch.testing.assert_close(adv, expected)
    assert metrics["grop/penalty_mean"] == pytest.approx(float(pen.mean()))
    assert metrics["grop/penalised_frac"] == pytest.approx(float((pen < 0).float().mean()))
    assert METHODS[name].applies_grop
    adv_off, _ = fn(tlr, mask, index=uids, config=_algo(grop={"enable": False}), entropy=ent)
    assert not torch.equal(adv_off, adv)


def test_gtpo_conflict_mask_through_the_adapter():
    from gtpo.algorithms.conflict_tokens import conflict_weights

    tlr, mask, uids, ent, responses = _verl_batch(6)
    cfg = _algo(gtpo={"conflict_mask": True})
    metrics: dict = {}
    adv, _ = compute_gtpo_advantage(
        tlr, mask, index=uids, config=cfg, entropy=ent, responses=responses, metrics=metrics
    )
    gid, ng = group_ids(uids)
    base, _ = gtpo_token_advantages(ent, mask, tlr.sum(-1), gid, ng)
    polarity = torch.where(tlr.sum(-1) > 0, 1, -1).to(torch.int8)
    lam, is_conflict = conflict_weights(responses, mask, gid, ng, polarity, 2.0, 0.0)
    torch.testing.assert_close(adv, base * lam)
    assert metrics["gtpo/conflict_token_frac"] == pytest.approx(float(is_conflict.sum()) / float(mask.sum()))
    with pytest.raises(ValueError, match="responses"):
        compute_gtpo_advantage(tlr, mask, index=uids, config=cfg, entropy=ent)


# ---------------------------------------------------------------------------------------------------------------------
# registered GRPO-S policy loss with a worker-built actor config


@pytest.fixture(scope="module")
def composed():
    """ppo_trainer composed with each method preset (configs/method/*.yaml), as the recipe's searchpath does."""
    from hydra import compose, initialize_config_module

    out = {}
    for method in ("gtpo", "grpo_s"):
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            out[method] = compose(
                config_name="ppo_trainer",
                overrides=[
                    f"hydra.searchpath=[file://{REPO / 'configs'}]",
                    f"+method={method}",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                ],
            )
    return out


@pytest.fixture()
def actor_config(composed):
    from verl.utils.config import omega_conf_to_dataclass

    cfg = omega_conf_to_dataclass(composed["grpo_s"].actor_rollout_ref.actor)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None)
    return cfg


def test_presets_compose_into_verl_dataclasses(composed):
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    for method, loss_mode, agg in (("gtpo", "vanilla", "token-mean"), ("grpo_s", "grpo_s", "seq-mean-token-mean")):
        cfg = composed[method]
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        # GROP on in both presets (paper §3.1); its block is the recipe's own (declared in gtpo_trainer.yaml), not
        # a field of verl's AlgoConfig
        assert cfg.algorithm.grop.enable is True
        algo_node = OmegaConf.create({k: v for k, v in cfg.algorithm.items() if k != "grop"})
        algo = omega_conf_to_dataclass(algo_node)
        assert algo.adv_estimator == method
        assert actor.policy_loss.loss_mode == loss_mode and actor.loss_agg_mode == agg
        assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
        assert actor.use_kl_loss is False and algo.use_kl_in_reward is False
        assert algo.filter_groups.enable is True and algo.filter_groups.metric == "acc"


def test_preset_files_format():
    for method in ("gtpo", "grpo_s"):
        lines = (REPO / "configs" / "method" / f"{method}.yaml").read_text().splitlines()
        assert lines[0] == "# @package _global_"
        for i, line in enumerate(lines):
            body = line.strip()
            if body and not body.startswith("#"):
                assert "#" not in body, f"inline comment in {method}.yaml:{i + 1}"
                assert lines[i - 1].strip().startswith("#"), f"{method}.yaml:{i + 1} has no comment above it"


def _loss_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, L = 5, 6
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    old = -3 * torch.rand(B, L, generator=g)
    delta = 0.1 * torch.randn(B, L, generator=g)
    delta[2] = 0.6  # sequence ratio e^0.6 > 1.28 with A > 0: clipped high
    delta[4] = -0.5  # e^-0.5 < 0.8 with A < 0: clipped low
    adv = torch.tensor([1.2, -0.7, 0.9, 0.4, -1.1])[:, None] * mask
    return old, old + delta, adv, mask


def test_registered_loss_closed_form_and_gradients(actor_config):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    old, new, adv, mask = _loss_inputs()
    logp = new.clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("grpo_s")(
        old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
        loss_agg_mode=actor_config.loss_agg_mode, config=actor_config,
    )  # fmt: skip
    m = mask.float()
    lens = m.sum(-1)
    ratio = torch.exp(new - old)
    w = (ratio * m).sum(-1) / lens
    a = adv[:, 0]
    per_seq = -torch.minimum(w * a, w.clamp(0.8, 1.28) * a)
    torch.testing.assert_close(loss.detach(), per_seq.mean(), atol=1e-6, rtol=1e-6)  # (1/G) sum_i l_i
    loss.backward()
    clipped = torch.tensor([False, False, True, False, True])
    grad = -a[:, None] * ratio / lens[:, None] / len(a) * m
    grad[clipped] = 0
    torch.testing.assert_close(logp.grad, grad, atol=1e-7, rtol=1e-5)
    assert metrics["grpo_s/seq_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["grpo_s/seq_clipfrac_high"] == pytest.approx(1 / 5)
    assert metrics["grpo_s/seq_clipfrac_low"] == pytest.approx(1 / 5)
    assert metrics["grpo_s/seq_ratio_max"] == pytest.approx(math.exp(0.6), rel=1e-5)
    assert set(metrics) == {
        "grpo_s/seq_ratio_mean", "grpo_s/seq_ratio_min", "grpo_s/seq_ratio_max", "grpo_s/seq_clipfrac",
        "grpo_s/seq_clipfrac_high", "grpo_s/seq_clipfrac_low", "grpo_s/ppo_kl",
    }  # fmt: skip
    assert all(isinstance(v, float) for v in metrics.values())


def test_registered_loss_on_policy(actor_config):
    old, _, adv, mask = _loss_inputs(1)
    logp = old.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss_grpo_s(old, logp, adv, mask, "seq-mean-token-mean", actor_config)
    assert metrics["grpo_s/seq_ratio_mean"] == 1.0 and metrics["grpo_s/seq_clipfrac"] == 0.0
    assert metrics["grpo_s/ppo_kl"] == 0.0
    torch.testing.assert_close(loss.detach(), -adv[:, 0].mean())
    loss.backward()
    lens = mask.float().sum(-1, keepdim=True)
    torch.testing.assert_close(logp.grad, -adv / lens / 5 * mask)


def test_registered_loss_micro_batches_sum_to_mini_batch(actor_config):
    """With global_batch_size set (as ppo_loss does), micro-batch losses add up to the mini-batch mean."""
    old, new, adv, mask = _loss_inputs(2)
    full, _ = compute_policy_loss_grpo_s(old, new, adv, mask, "seq-mean-token-mean", actor_config)
    actor_config.global_batch_info.update(global_batch_size=5)
    parts = [
        compute_policy_loss_grpo_s(old[s], new[s], adv[s], mask[s], "seq-mean-token-mean", actor_config)[0]
        for s in (slice(0, 2), slice(2, 5))
    ]
    torch.testing.assert_close(sum(parts), full, atol=1e-6, rtol=1e-6)


def test_registered_loss_token_mean_is_length_weighted(actor_config):
    old, new, adv, mask = _loss_inputs(3)
    seq, _ = compute_policy_loss_grpo_s(old, new, adv, mask, "seq-mean-token-mean", actor_config)
    tok, _ = compute_policy_loss_grpo_s(old, new, adv, mask, "token-mean", actor_config)
    m = mask.float()
    lens = m.sum(-1)
    w = (torch.exp(new - old) * m).sum(-1) / lens
    a = adv[:, 0]
    per_seq = -torch.minimum(w * a, w.clamp(0.8, 1.28) * a)
    torch.testing.assert_close(tok, (per_seq * lens).sum() / lens.sum(), atol=1e-6, rtol=1e-6)
    assert abs(float(seq - tok)) > 1e-4


def test_registered_loss_applies_rollout_is_weights(actor_config):
    old, new, adv, mask = _loss_inputs(4)
    base, _ = compute_policy_loss_grpo_s(old, new, adv, mask, "seq-mean-token-mean", actor_config)
    scaled, _ = compute_policy_loss_grpo_s(
        old, new, adv, mask, "seq-mean-token-mean", actor_config, rollout_is_weights=torch.full(old.shape, 0.5)
    )
    torch.testing.assert_close(scaled, 0.5 * base)


def test_registered_loss_detaches_entropy_path(actor_config):
    """Entropy -> GRPO-S advantages -> registered loss: no gradient reaches the entropy's logits."""
    torch.manual_seed(0)
    logits_h = torch.randn(4, 3, 5, requires_grad=True)
    lp = torch.log_softmax(logits_h, -1)
    ent = -(lp.exp() * lp).sum(-1)
    mask = torch.ones(4, 3, dtype=torch.bool)
    tlr = torch.zeros(4, 3)
    tlr[:, -1] = torch.tensor([1.0, -1.0, 1.0, -1.0])
    adv, _ = compute_grpo_s_advantage(tlr, mask, index=np.array(["a"] * 4, dtype=object), entropy=ent)
    logp = torch.randn(4, 3, requires_grad=True)
    loss, _ = compute_policy_loss_grpo_s(logp.detach() - 0.1, logp, adv, mask, "seq-mean-token-mean", actor_config)
    loss.backward()
    assert logits_h.grad is None and logp.grad is not None
