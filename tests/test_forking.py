"""DAPO w/ Forking Tokens (arXiv 2506.01939): top-rho entropy mask and the loss hook through verl's ppo_loss.

Run: cd /work/main && .venv/bin/pytest -q tests/test_forking.py

Checks the quantile against hand-computed values, ties, padding, zero gradient through the mask, the denominator
(= selected count), micro-batch / DP splitting, and the batch scope.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from gtpo.algorithms.token_selection import entropy_threshold, top_entropy_mask
from tests.support.forking import actor_config, forking_params, micro_batch

PAD_H = 100.0  # a huge entropy on padding: selecting padding would be visible


def test_hand_computed_quantile_and_padding():
    ent = torch.tensor([[0.1, 0.5, 0.9, PAD_H], [0.3, 0.7, PAD_H, PAD_H]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    mask, tau = top_entropy_mask(ent, valid, rho=0.4)  # n = 5, k = ceil(2.0) = 2 -> {0.9, 0.7}
    assert tau.item() == pytest.approx(0.7)
    assert mask.tolist() == [[False, False, True, False], [False, True, False, False]]
    mask, tau = top_entropy_mask(ent, valid, rho=0.2)  # k = 1 -> {0.9}
    assert tau.item() == pytest.approx(0.9) and int(mask.sum()) == 1
    mask, tau = top_entropy_mask(ent, valid, rho=0.5)  # k = ceil(2.5) = 3 -> {0.9, 0.7, 0.5}
    assert tau.item() == pytest.approx(0.5) and int(mask.sum()) == 3
    mask, _ = top_entropy_mask(ent, valid, rho=1.0)
    assert torch.equal(mask, valid.bool())


def test_ties_are_all_selected_and_order_free():
    ent = torch.tensor([[1.0, 0.5, 1.0, 1.0]])
    valid = torch.ones(1, 4)
    mask, tau = top_entropy_mask(ent, valid, rho=0.25)  # k = 1 but three tokens tie at the threshold
    assert tau.item() == 1.0 and mask.tolist() == [[True, False, True, True]]
    perm = torch.tensor([3, 1, 0, 2])
    mask_p, _ = top_entropy_mask(ent[:, perm], valid, rho=0.25)
    assert torch.equal(mask_p, mask[:, perm])


def test_k_is_guarded_against_float_rounding():
    """``0.28 * 25`` is ``7.000000000000001`` in floating point: k = ceil(rho * n) must still be 7, so exactly 7 of
    25 distinct entropies are selected (the 7 largest), not 8."""
    assert 0.28 * 25 > 7
    ent = torch.arange(25, dtype=torch.float32).reshape(5, 5) / 10
    mask, tau = top_entropy_mask(ent, torch.ones(5, 5, dtype=torch.bool), rho=0.28)
    assert int(mask.sum()) == 7
    assert tau.item() == pytest.approx(1.8)  # the 7th largest of 0.0 .. 2.4
    assert torch.equal(mask.flatten(), torch.arange(25) >= 18)


def test_random_no_ties_selects_exactly_ceil_rho_n():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        b, L = torch.randint(1, 6, (2,), generator=g).tolist()
        ent = torch.rand(b, L, generator=g)
        valid = torch.rand(b, L, generator=g) > 0.3
        rho = float(torch.rand(1, generator=g).clamp(min=0.01))
        mask, tau = top_entropy_mask(ent, valid, rho)
        n = int(valid.sum())
        if n == 0:
            assert not mask.any() and math.isinf(tau.item())
            continue
        assert int(mask.sum()) == math.ceil(rho * n - 1e-9)
        assert not (mask & ~valid).any()
        if (valid & ~mask).any():
            assert ent[mask].min() > ent[valid & ~mask].max()


def test_bad_rho_raises():
    for rho in (0.0, -0.1, 1.5, True):
        with pytest.raises(ValueError, match="rho"):
            entropy_threshold(torch.ones(2), torch.ones(2, dtype=torch.bool), rho)


def test_no_gradient_through_mask():
    ent = torch.rand(2, 3, requires_grad=True)
    mask, tau = top_entropy_mask(ent, torch.ones(2, 3), rho=0.5)
    assert not mask.requires_grad and not tau.requires_grad and mask.dtype == torch.bool


# ------------------------------------------------------------------------------------------- loss hook (verl)


def _loss(params, *args, **kwargs):
    from gtpo.verl_plugin.actor_loss import ForkingPPOLoss

    data, out, logp, ent_leaf = micro_batch(*args, **kwargs)
    loss, metrics = ForkingPPOLoss(actor_config(), params)(out, data)
    loss.backward()
    return loss, metrics, logp.grad, ent_leaf.grad


def test_denominator_is_selected_count_and_gradient_only_on_selected():
    ents = [[0.1, 0.9, 0.3], [0.8, 0.2]]
    advs = [[1.0, 2.0, 3.0], [-4.0, 5.0]]
    loss, metrics, grad, ent_grad = _loss(forking_params(rho=0.4), [2, 3], ents, advs)
    # n = 5, k = 2 -> tokens with H 0.9 (A=2) and 0.8 (A=-4); vanilla loss at ratio 1 is -A.
    assert loss.item() == pytest.approx(-(2.0 - 4.0) / 2)
    # Gradient w.r.t. log-probs: -A / n_sel on the selected tokens only (prompt positions and others 0).
    expected = torch.zeros_like(grad)
    expected[2] = -2.0 / 2  # row 0 response token 1 -> flat index 0 + 2 - 1 + 1
    expected[5 + 3 - 1 + 0] = 4.0 / 2  # row 1 response token 0
    torch.testing.assert_close(grad, expected)
    # No gradient reaches the entropy, neither through the mask nor through verl's (zero-weighted) entropy loss.
    assert ent_grad is None
    assert metrics["forking/selected_token_frac"].values == [pytest.approx(2 / 5)]
    assert metrics["forking/entropy_threshold"].values == [pytest.approx(0.8)]


def test_micro_batches_and_dp_ranks_recombine_to_the_global_selected_mean():
    ents = [[0.1, 0.9, 0.3, 0.2, 0.95], [0.8, 0.05, 0.4, 0.5, 0.6]]
    advs = [[1.0, 2.0, 3.0, 4.0, 5.0], [-1.0, -2.0, -3.0, -4.0, -5.0]]
    # Whole batch in one micro-batch, rho 0.2 of 10 tokens -> 0.95 (A=5) and 0.9 (A=2).
    full, *_ = _loss(forking_params(rho=0.2), [2, 2], ents, advs)
    assert full.item() == pytest.approx(-(5.0 + 2.0) / 2)
    # Gradient accumulation: two micro-batches of one row, each selecting 1 of 5 (the same tokens here).
    parts = [_loss(forking_params(rho=0.2), [2], [ents[i]], [advs[i]], batch_num_tokens=10)[0] for i in range(2)]
    # Row 1 selects its own top token (0.8, A=-1) instead: the paper's per-micro-batch quantile.
    assert sum(p.item() for p in parts) == pytest.approx(-(5.0 - 1.0) / 2)
    # DP = 2: each rank's loss is scaled by dp_size, DDP averages the gradients -> same total.
    ranks = [
        _loss(forking_params(rho=0.2), [2], [ents[i]], [advs[i]], dp_size=2, batch_num_tokens=10)[0] for i in range(2)
    ]
    assert sum(r.item() for r in ranks) / 2 == pytest.approx(sum(p.item() for p in parts))


def test_batch_scope_uses_driver_threshold_and_fraction():
    from gtpo.algorithms.token_selection import FRACTION_KEY, THRESHOLD_KEY, batch_threshold_extra_info

    old = [[0.1, 0.9, 0.3], [0.8, 0.2]]
    padded = torch.tensor([[0.1, 0.9, 0.3], [0.8, 0.2, PAD_H]])
    info = batch_threshold_extra_info(padded, torch.tensor([[1, 1, 1], [1, 1, 0]]), rho=0.2)
    assert info[THRESHOLD_KEY] == pytest.approx(0.9) and info[FRACTION_KEY] == pytest.approx(1 / 5)
    # Training entropy differs from the old one: the batch scope selects on the old entropy.
    train_ents = [[0.9, 0.1, 0.1], [0.1, 0.1]]
    loss, metrics, grad, _ = _loss(
        forking_params(rho=0.2, scope="batch"),
        [2, 3],
        train_ents,
        [[1.0, 2.0, 3.0], [4.0, 5.0]],
        extra=info,
        old_ent=old,
    )
    # Selected: the old-entropy 0.9 token (A=2); denominator rho_B * N = 0.2 * 5 = 1.
    assert loss.item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="driver hook"):
        _loss(forking_params(rho=0.2, scope="batch"), [2], [[0.1]], [[1.0]])


def test_no_backward_into_the_entropy_without_an_entropy_bonus():
    """verl's ppo_loss subtracts entropy_coeff * entropy_loss even at entropy_coeff = 0; that zero gradient would make
    the backward recompute verl's checkpointed chunked entropy with autograd (tokens x vocabulary x 4 B x 2). The
    forking loss hands ppo_loss the entropy detached: nothing reaches it, and the loss and the log-prob gradient are
    the ones of the undetached path. With an entropy bonus the gradient reaches it, as in verl."""
    import dataclasses

    from verl.workers.utils.losses import ppo_loss

    from gtpo.verl_plugin.actor_loss import ForkingPPOLoss

    args = ([2, 3], [[0.1, 0.9, 0.3], [0.8, 0.2]], [[1.0, 2.0, 3.0], [-4.0, 5.0]])
    loss, metrics, grad, ent_grad = _loss(forking_params(rho=0.4), *args)
    assert ent_grad is None, "the entropy took part in the backward"
    assert "actor/entropy_loss" in metrics  # verl's entropy metric is still computed

    # negative control: verl's own loss on the same outputs backpropagates (zeros) into the entropy
    data, out, logp, ent_leaf = micro_batch(*args)
    verl_loss, _ = ppo_loss(actor_config(), out, data)
    verl_loss.backward()
    assert ent_leaf.grad is not None and torch.all(ent_leaf.grad == 0)

    bonus = dataclasses.replace(actor_config(), entropy_coeff=0.01)
    data, out, logp, ent_leaf = micro_batch(*args)
    bonus_loss, _ = ForkingPPOLoss(bonus, forking_params(rho=0.4))(out, data)
    bonus_loss.backward()
    assert ent_leaf.grad is not None and torch.any(ent_leaf.grad != 0)
    torch.testing.assert_close(logp.grad, grad)  # the bonus does not touch the log-prob gradient


def test_errors_for_missing_entropy_and_wrong_agg_mode():
    from gtpo.algorithms.token_selection import ForkingParams
    from gtpo.methods import knob
    from gtpo.verl_plugin.actor_loss import ForkingPPOLoss

    with pytest.raises(ValueError, match="token-mean"):
        ForkingPPOLoss(actor_config("seq-mean-token-mean"), forking_params())
    data, out, *_ = micro_batch([2], [[0.5, 0.6]], [[1.0, 1.0]])
    out.pop("entropy")
    with pytest.raises(ValueError, match="calculate_entropy"):
        ForkingPPOLoss(actor_config(), forking_params())(out, data)
    with pytest.raises(ValueError, match=r"algorithm\.forking\.scope"):
        knob({"forking": {"scope": "global"}}, "forking")
    with pytest.raises(ValueError, match=r"algorithm\.forking\.rho"):
        knob({"forking": {"rho": 0}}, "forking")
    assert knob({}, "forking") == ForkingParams()


class _WorkerGroup:
    """The actor worker group's ``set_loss_fn``, recorded."""

    loss = None

    def set_loss_fn(self, fn):
        self.loss = fn


def _install_trainer(forking: dict, loss_mode: str = "vanilla", distillation: bool = False):
    """A trainer stand-in with what :func:`gtpo.verl_plugin.actor_loss.install` reads: the algorithm and actor config,
    distillation, and the actor worker group."""
    from omegaconf import OmegaConf

    actor = {
        "_target_": "verl.workers.config.FSDPActorConfig",
        "strategy": "fsdp",
        "rollout_n": 2,
        "ppo_micro_batch_size_per_gpu": 2,
        "ppo_mini_batch_size": 2,
        "loss_agg_mode": "token-mean",
        "calculate_entropy": True,
        "policy_loss": {"loss_mode": loss_mode},
    }
    config = {"algorithm": {"forking": forking}, "actor_rollout_ref": {"actor": actor}}
    config["distillation"] = {"enabled": distillation}
    return SimpleNamespace(config=OmegaConf.create(config), actor_rollout_wg=_WorkerGroup())


def test_install_sets_loss_only_when_enabled():
    from gtpo.verl_plugin.actor_loss import ForkingPPOLoss, install

    t = _install_trainer({"enable": False})
    assert install(t) is None and t.actor_rollout_wg.loss is None
    t = _install_trainer({"enable": True, "rho": 0.2})
    assert install(t).rho == 0.2 and isinstance(t.actor_rollout_wg.loss, ForkingPPOLoss)


@pytest.mark.parametrize(
    "forking, distillation, installed",
    [(False, False, "ExtremaPPOLoss"), (True, False, "ForkingPPOLoss"), (False, True, None)],
)
def test_install_gives_the_grpo_s_loss_its_extremes(forking, distillation, installed):
    """With the grpo_s policy loss the workers get verl's ppo_loss re-tagging its min / max metrics
    (tests/test_loss_metrics.py); the forking loss does that itself; verl's distillation keeps its own loss."""
    from gtpo.verl_plugin.actor_loss import install

    trainer = _install_trainer({"enable": forking}, loss_mode="grpo_s", distillation=distillation)
    install(trainer)
    loss = trainer.actor_rollout_wg.loss
    assert (type(loss).__name__ if loss is not None else None) == installed
    if loss is not None:
        assert loss.config.policy_loss.get("loss_mode") == "grpo_s"
