"""The recipe's estimators give the same advantages from a bf16 run's entropy as from an fp32 run's, within a bound.

    .venv/bin/python -m pytest -q -n 0 -p no:cacheprovider tests/test_bf16_entropy.py

Why: the GPU presets (configs/model/*.yaml) train with FSDP2 mixed precision, ``param_dtype: bf16`` (verl's
default), while every CPU test runs fp32 end to end (configs/backend/cpu_tiny.yaml). The old-log-prob pass hands
the estimators the per-token entropy of the old policy; on a GPU it comes from a bf16 forward. Where verl
upcasts: ``FSDPEngine.forward_step`` runs the model under ``torch.autocast(dtype=param_dtype)``; Qwen2's
``lm_head`` then returns bf16 logits (transformers 5 no longer upcasts them), and on the remove-padding path
``prepare_model_outputs`` hands the packed ``[total_nnz, vocab]`` bf16 logits to
``entropy_from_logits_with_chunking`` (the presets set ``entropy_from_logits_with_chunking: true``), which upcasts
each chunk with ``.float()`` and returns fp32 entropy. So the estimators see fp32 entropy of bf16-rounded logits of
a bf16 forward, never bf16 entropy.

What: a tiny Qwen2 built as ``tests/support/dp.py`` builds it, with its final RMSNorm weight scaled by
:data:`LOGIT_SCALE` (the random model's next-token distributions are near uniform, ``H`` in [3.70, 3.75] nats, where
entropy is flat in the logits and bf16 moves it by only 5e-4; scaled, the response tokens' entropies span 0.04 to
2.5 nats, median 0.27, like a trained LM's on math, and bf16 moves them by up to 3.3 %). Two forwards over the
15 responses of ``S.GROUPS``, packed as verl's remove-padding layout: (a) fp32 weights, no autocast, entropy by
``entropy_from_logits``; (b) a copy with bf16 parameters (buffers such as the rotary ``inv_freq`` stay fp32, as
FSDP2's ``MixedPrecisionPolicy`` casts parameters only) under ``torch.autocast("cpu", bfloat16)``, entropy by
``entropy_from_logits_with_chunking`` inside the autocast, as the engine does. Log-probs: fp32 arithmetic on the
upcast logits, which is what flash-attn's cross-entropy kernel (verl's ``logprobs_from_logits`` on a GPU) does.
Each entropy goes to ``gtpo``, ``grpo_s`` and ``gtpo_traj`` through verl's registry with the recipe's composed
config, as ``tests/test_dp_equivalence.py`` calls them; verl's ``grpo`` is the control (it reads no entropy:
bitwise equal).

Checked: the bf16 entropy differs from the fp32 one (max abs > 1e-3, so the comparison is not vacuous; log-probs
move by at most ``2 max|dz|``, log-softmax being 2-Lipschitz in the max norm, ``dz`` the logit change); padding is
exactly 0 in both advantage tensors; the exact zeros coincide (zero-variance groups, filtered rows, the
``lam_neg = 0`` conflict tokens: structural, not entropy-dependent) and every other response token keeps its sign;
and every token's advantage moves by at most its bound below, plus 2e-6 of fp32 rounding.

The bounds, derived from the measured relative entropy error ``rho = max |H_bf16 - H_fp32| / H_fp32`` (over the
response tokens for ``gtpo``, over the per-response mean entropies ``Hbar`` for ``grpo_s``) with the fp32 run's
shaped rewards, not fitted:

* ``gtpo`` / ``grpo_s``: the shaped reward is ``x = a1 * base +- a2 * W`` with ``W = H * d_t / sum H`` (correct) or
  ``(1/H) * h_t / sum (1/H)`` (incorrect); the eps guards only pull the ratio towards 1. A relative error of at most
  ``rho`` in each ``H`` moves each ``W`` by a factor in ``[(1-rho)/(1+rho), (1+rho)/(1-rho)]``, so
  ``|dx_k| <= D_k = a2 * kappa * W_k``, ``kappa = 2 rho / (1 - rho)``; ``base`` (reward and GROP penalty: lengths
  and correctness only) does not move. Whitening ``A = (x - mean) / (std + eps)`` over a set (zero-filled field:
  batch tokens for ``gtpo``, a group's responses for ``grpo_s``) then gives exactly
  ``A'_k - A_k = (dx_k - mean dx) / (std' + eps) + A_k (std - std') / (std' + eps)`` with
  ``|std' - std| <= std(dx) <= R = sqrt(sum D^2 / (n - 1))``, hence
  ``|A'_k - A_k| <= (D_k + mean D + |A_k| R) / (std - R + eps)``.
* ``gtpo_traj``: ``adv = delta_i (A_i - gamma Hbar_i) lam_t`` and ``A_i`` comes from the rewards alone, so with the
  same filter decisions ``delta`` (checked: the ini gate and every row's ``Hbar <= tau`` agree)
  ``|adv' - adv| = gamma * lam_t * |dHbar_i| <= gamma * max(1, lam_pos, lam_neg)^2 * |dHbar_i|`` (a token in both
  conflict runs takes ``lam^2``).

Measured here (x86 CPU, torch 2.13, transformers 5.19), printed with ``-s``: entropy on the response tokens max abs
0.0153 nats, max relative 3.3 %, mean abs 0.0033 (logits max abs 0.041, log-probs 0.047). Advantages, max ``|dA|``
(the derived bound at that token; largest ``|A|``): ``gtpo`` 8.3e-3 (0.039; 1.96), ``grpo_s`` 9.5e-4 (5.1e-3; 1.5),
``gtpo_traj`` 1.8e-4 (7.2e-4; 2.9), ``grpo`` 0. For ``gtpo_traj`` the ini gate is on in both runs (``<H>_ini``
0.5933 vs 0.5941 < ln 2) and drops the same 3 of 15 rows: the closest ``Hbar`` is 0.064 from ``tau`` while bf16
moves an ``Hbar`` by at most 0.0077. The bounds are sound, not tight (about 4-5x the observed change at the
worst token): they assume every weight moves by the worst relative error in the worst direction. The bf16
arithmetic here is the CPU's (oneDNN bf16 GEMMs, SDPA attention), not CUDA's (flash-attention): the rounding that
dominates (bf16 weights, activations and logits) is the same kind, and the bounds are computed from the ``rho``
measured in the run, so the argument carries over to a GPU run; the numbers above do not transfer exactly.
Runtime: a few seconds after verl's import (which takes 5-15 s on 2 shared cores).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import numpy as np
import pytest
import torch

from gtpo.methods import METHODS as ROWS
from tests.support import dp as S

# the recipe's estimators: the rows of the method table that compute their own advantages
METHODS = tuple(name for name, row in ROWS.items() if row.advantages is not None)
LOGIT_SCALE = 8.0  # final RMSNorm weight x 8: entropies of an LM's spread (see the module docstring)
ROUNDING = 2e-6  # fp32 rounding of advantages of magnitude <= 3 (a few ulps), on top of each derived bound
MIN_ENTROPY_SHIFT = 1e-3  # the bf16 entropy must differ by more than this somewhere (observed 0.015)


# ----------------------------------------------------------------------------------------------------------------
# the two forwards


def _packed_forward(model, rows: list[dict], bf16: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [total_nnz, V], entropy [total_nnz] fp32, log_probs [total_nnz])`` of the rows packed one after the
    other, as verl's remove-padding path lays them out (each sequence is run on its own: attention never crosses a
    sequence boundary there either)."""
    from verl.utils import torch_functional as verl_F

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    labels = torch.roll(torch.cat([r["input_ids"] for r in rows]), shifts=-1)  # verl's input_ids_rmpad_rolled
    with torch.no_grad(), autocast:
        logits = torch.cat([model(input_ids=r["input_ids"][None]).logits[0] for r in rows])
        if bf16:  # FSDPEngine.prepare_model_outputs with entropy_from_logits_with_chunking (the presets)
            entropy = verl_F.entropy_from_logits_with_chunking(logits, chunk_size=2048)
        else:
            entropy = verl_F.entropy_from_logits(logits)
    with torch.no_grad():
        log_probs = verl_F.logprobs_from_logits(logits.float(), labels)
    return logits, entropy, log_probs


def _responses(packed: torch.Tensor, rows: list[dict]) -> torch.Tensor:
    """``[B, MAX_RESPONSE]``: each response token's value from the position that predicts it, zero-padded."""
    out, offset = [], 0
    for r in rows:
        start, n = offset + len(r["prompts"]) - 1, len(r["responses"])
        out.append(torch.nn.functional.pad(packed[start : start + n], (0, S.MAX_RESPONSE - n)))
        offset += len(r["input_ids"])
    return torch.stack(out)


def _padded(rows: list[dict], name: str) -> torch.Tensor:
    return torch.stack([torch.nn.functional.pad(r[name], (0, S.MAX_RESPONSE - len(r[name]))) for r in rows])


@pytest.fixture(scope="module")
def run():
    import gtpo.verl_plugin.register  # noqa: F401

    torch.manual_seed(0)
    fp32, _ = S.build_models()
    with torch.no_grad():
        fp32.model.norm.weight.mul_(LOGIT_SCALE)
    bf16 = copy.deepcopy(fp32)
    for p in bf16.parameters():  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16): parameters, not buffers
        p.data = p.data.to(torch.bfloat16)
    assert bf16.lm_head.weight.dtype == torch.bfloat16  # tied to the embedding, cast once
    assert all(b.dtype == torch.float32 for b in bf16.buffers())

    _, rows, _ = S.rollout_rows(S.build_tokenizer())
    out = {"rows": rows}
    for name, model in (("fp32", fp32), ("bf16", bf16)):
        logits, entropy, log_probs = _packed_forward(model, rows, bf16=name == "bf16")
        out[name] = {"logits": logits, "entropy": entropy, "log_probs": log_probs, "H": _responses(entropy, rows)}
    out["mask"] = _padded(rows, "response_mask")
    out["rewards"] = _padded(rows, "rm_scores")
    out["responses"] = _padded(rows, "responses")
    out["index"] = np.array([r["uid"] for r in rows], dtype=object)
    return out


@functools.cache
def _config(method: str):
    """The recipe's composed config for ``method`` (composing takes most of a second: once per method)."""
    return S.compose_config(method, "unused")


def _advantages(run, method: str, entropy: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The estimator through verl's registry, as ``test_dp_equivalence`` and the recipe's driver call it."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    cfg = _config(method)
    metrics: dict = {}
    adv, _ = get_adv_estimator_fn(method)(
        token_level_rewards=run["rewards"],
        response_mask=run["mask"],
        index=run["index"],
        config=cfg.algorithm,
        entropy=entropy,
        responses=run["responses"],
        metrics=metrics,
    )
    return adv, metrics


# ----------------------------------------------------------------------------------------------------------------
# the derived bounds


def _whitening_bound(x: torch.Tensor, d: torch.Tensor, abs_adv: torch.Tensor, eps: float) -> torch.Tensor:
    """Bound on ``|A' - A|`` for ``A = (x - mean) / (std + eps)`` (unbiased std) over one set when each ``x_k`` moves
    by at most ``d_k`` (see the module docstring)."""
    n = x.numel()
    std = x.std()
    r = torch.sqrt((d**2).sum() / (n - 1))
    assert std > 2 * r, "the entropy perturbation must be small against the field's spread for the bound"
    return (d + d.mean() + abs_adv * r) / (std - r + eps)


def _relative_error(new: torch.Tensor, old: torch.Tensor) -> float:
    assert bool((old > 0).all())
    return float(((new - old).abs() / old).max())


def _gtpo_bound(run, adv32: torch.Tensor) -> torch.Tensor:
    from gtpo.algorithms.group_ops import group_ids
    from gtpo.algorithms.gtpo_token import gtpo_shaped_rewards, reward_bases
    from gtpo.algorithms.length_penalty import grop_penalty
    from gtpo.methods import knob

    cfg = _config("gtpo").algorithm
    params = knob(cfg, "gtpo")
    assert (params.norm_mode, params.norm_scope, params.std) == ("zero_fill", "batch", "unbiased")
    valid = run["mask"].bool()
    h32, h16 = run["fp32"]["H"].double(), run["bf16"]["H"].double()
    rho = _relative_error(h16[valid], h32[valid])
    kappa = 2 * rho / (1 - rho)

    gid, ng = group_ids(run["index"])
    rewards = run["rewards"].sum(-1)
    correct = rewards > params.reward_threshold
    pen = grop_penalty(run["mask"].sum(-1), correct, gid, ng, params=knob(cfg, "grop"))
    x = gtpo_shaped_rewards(run["fp32"]["H"], run["mask"], rewards, gid, ng, params, reward_offset=pen)
    base = reward_bases(rewards, correct, params.negative_base, pen)
    d = kappa * (x - params.alpha1 * base[:, None]).abs()  # a2 * kappa * W, W = share * count

    bound = torch.zeros_like(x)
    for own_rows in (correct, ~correct):  # the r~+ field, then the r~- field, each zero-filled over the batch
        own = valid & own_rows[:, None]
        b = _whitening_bound(
            torch.where(own, x, 0.0)[valid], torch.where(own, d, 0.0)[valid], adv32[valid].double().abs(), params.eps
        )
        bound[own] = b[own[valid]]
    return bound


def _grpo_s_bound(run, adv32: torch.Tensor) -> torch.Tensor:
    from gtpo.algorithms.group_ops import group_ids
    from gtpo.algorithms.grpo_s import grpo_s_sequence_rewards, sequence_entropy
    from gtpo.algorithms.gtpo_token import reward_bases
    from gtpo.algorithms.length_penalty import grop_penalty
    from gtpo.methods import knob

    cfg = _config("grpo_s").algorithm
    params = knob(cfg, "grpo_s")
    assert (params.norm_mode, params.std) == ("zero_fill", "unbiased")
    hbar32 = sequence_entropy(run["fp32"]["H"], run["mask"])
    hbar16 = sequence_entropy(run["bf16"]["H"], run["mask"])
    rho = _relative_error(hbar16, hbar32)
    kappa = 2 * rho / (1 - rho)

    gid, ng = group_ids(run["index"])
    rewards = run["rewards"].sum(-1)
    correct = rewards > params.reward_threshold
    pen = grop_penalty(run["mask"].sum(-1), correct, gid, ng, params=knob(cfg, "grop"))
    x = grpo_s_sequence_rewards(hbar32, rewards, gid, ng, params, reward_offset=pen)
    base = reward_bases(rewards, correct, params.negative_base, pen)
    d = kappa * (x - params.beta1 * base).abs()  # b2 * kappa * W
    abs_adv = adv32[:, 0].double().abs()  # every response is non-empty: its first token carries its advantage

    bound = torch.zeros_like(x)
    for g in range(ng):
        members = gid == g
        for own_rows in (correct, ~correct):
            own = members & own_rows
            b = _whitening_bound(
                torch.where(own, x, 0.0)[members], torch.where(own, d, 0.0)[members], abs_adv[members], params.eps
            )
            bound[own] = b[own[members]]
    return bound[:, None].expand_as(adv32)


def _gtpo_traj_bound(run, adv32: torch.Tensor, metrics: dict[str, dict]) -> torch.Tensor:
    from gtpo.algorithms.grpo_s import sequence_entropy
    from gtpo.methods import knob

    params = knob(_config("gtpo_traj").algorithm, "gtpo_traj")
    assert params.agg == "paper_mean" and not params.divide_by_nconf  # no per-row factor beyond lam
    hbar32 = sequence_entropy(run["fp32"]["H"], run["mask"])
    hbar16 = sequence_entropy(run["bf16"]["H"], run["mask"])
    # the same filter decisions: the ini gate, and (when it is on) the kept rows
    gate = {k: m["gtpo_traj/filter_on"] for k, m in metrics.items()}
    assert gate["fp32"] == gate["bf16"], gate
    if gate["fp32"]:
        assert torch.equal(hbar32 <= params.tau, hbar16 <= params.tau), (hbar32, params.tau)
    lam_max = max(1.0, params.lam_pos, params.lam_neg) ** 2
    return (params.gamma * lam_max * (hbar16 - hbar32).abs())[:, None].expand_as(adv32)


# ----------------------------------------------------------------------------------------------------------------
# tests


def test_bf16_forward_moves_the_entropy(run):
    """The bf16 forward (bf16 logits, fp32 entropy after the chunked upcast) differs from the fp32 one: entropy by
    more than :data:`MIN_ENTROPY_SHIFT` somewhere on the response tokens, log-probs by at most twice the logit
    change at their position."""
    from verl.utils import torch_functional as verl_F

    fp32, bf16 = run["fp32"], run["bf16"]
    assert fp32["logits"].dtype == torch.float32 and bf16["logits"].dtype == torch.bfloat16
    assert fp32["entropy"].dtype == bf16["entropy"].dtype == torch.float32  # what the estimators receive
    # the chunked function is the plain one on the upcast logits (one chunk here)
    assert torch.equal(bf16["entropy"], verl_F.entropy_from_logits(bf16["logits"].float()))

    valid = run["mask"].bool()
    dh = (bf16["H"] - fp32["H"]).abs()[valid]
    rel = dh / fp32["H"][valid]
    assert float(dh.max()) > MIN_ENTROPY_SHIFT, f"bf16 entropy max abs diff {float(dh.max()):.3g}"
    assert float(fp32["H"][valid].min()) > 0.01

    dz = (bf16["logits"].float() - fp32["logits"]).abs().amax(-1)
    dlogp = (bf16["log_probs"] - fp32["log_probs"]).abs()
    assert bool((dlogp <= 2 * dz + 1e-5).all())
    assert float(dlogp.max()) > 0
    print(
        f"\nentropy: max abs {float(dh.max()):.3g}, max rel {float(rel.max()):.3g}, mean abs {float(dh.mean()):.3g}; "
        f"logits max abs {float(dz.max()):.3g}; log-probs max abs {float(dlogp.max()):.3g}"
    )


@pytest.mark.parametrize("method", METHODS)
def test_advantages_agree_within_the_derived_bound(run, method):
    """bf16 vs fp32 entropy: padding exactly 0 in both, the same exact zeros, the same signs elsewhere, and every
    token within its derived bound (module docstring) plus :data:`ROUNDING`."""
    adv32, m32 = _advantages(run, method, run["fp32"]["H"])
    adv16, m16 = _advantages(run, method, run["bf16"]["H"])
    valid = run["mask"].bool()

    assert not adv32[~valid].any() and not adv16[~valid].any()
    assert torch.equal(adv32[valid] == 0, adv16[valid] == 0)
    nonzero = valid & (adv32 != 0)
    assert bool(nonzero.any())
    assert torch.equal(torch.sign(adv32[nonzero]), torch.sign(adv16[nonzero]))

    if method == "gtpo":
        bound = _gtpo_bound(run, adv32)
    elif method == "grpo_s":
        bound = _grpo_s_bound(run, adv32)
    else:
        bound = _gtpo_traj_bound(run, adv32, {"fp32": m32, "bf16": m16})
    diff = (adv16 - adv32).abs().double()
    assert float(diff.max()) > 0, "the entropy-dependent advantages should move"
    excess = diff - bound - ROUNDING
    worst = int(excess[valid].argmax())
    assert bool((excess[valid] <= 0).all()), (
        f"{method}: |dA| {float(diff[valid][worst]):.3g} > bound {float(bound[valid][worst]):.3g}"
    )
    top = int(diff[valid].argmax())
    print(
        f"\n{method}: max |dA| {float(diff.max()):.3g} (bound there {float(bound[valid][top]):.3g}), "
        f"largest bound {float(bound[valid].max()):.3g}, max |A| {float(adv32.abs().max()):.3g}"
    )


def test_grpo_control_is_bitwise_equal(run):
    """verl's ``grpo`` reads no entropy: the same advantages bit for bit (the harness feeds both runs the same
    rewards, masks and groups)."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    cfg = _config("gtpo").algorithm
    out = []
    for _ in ("fp32", "bf16"):
        adv, _ = get_adv_estimator_fn("grpo")(
            token_level_rewards=run["rewards"],
            response_mask=run["mask"],
            index=run["index"],
            norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo,
            config=cfg,
        )
        out.append(adv)
    assert torch.equal(out[0], out[1]) and out[0].abs().sum() > 0
    assert not out[0][~run["mask"].bool()].any()


def test_logit_scale_gives_an_lm_like_entropy_spread(run):
    """The premise of :data:`LOGIT_SCALE`: response-token entropies from below 0.1 to above 2 nats (ln(vocab) =
    3.76), median below 1, where the unscaled model's are all within 2 % of ln(vocab)."""
    h = run["fp32"]["H"][run["mask"].bool()]
    vocab = run["fp32"]["logits"].shape[-1]
    assert float(h.min()) < 0.1 and float(h.max()) > 2.0 and float(h.median()) < 1.0
    assert float(h.max()) < math.log(vocab)
