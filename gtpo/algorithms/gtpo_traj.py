"""GTPO-trajectory (``gtpo_traj``): conflict-token weights, entropy filter and entropy penalty.

Paper: Simoni, Fontana, Rossolini, Saracino (, Mori), "GTPO: Trajectory-Based Policy Optimization in LLMs" /
"GTPO: Stabilizing Group Relative Policy Optimization via Gradient and Entropy Control", arXiv 2508.03772
(TACL 2026). Official code: ``winstonsmith1897/GTPO``. Specification: docs/ALGORITHMS.md §6. Knobs:
``algorithm.gtpo_traj`` (:class:`GTPOTrajParams`). This file holds the knobs, the definition
(:func:`gtpo_traj_definition`, torch), the entry point (:func:`gtpo_traj_advantages`; :func:`trajectory` with every
intermediate: CPU tensors go to the compiled kernel, :mod:`gtpo.algorithms.kernels`).

- Objective (§6.1): ``J = E[ 1/G sum_i delta_i (A_i - gamma <H>_i) / |o_i| sum_t r_{i,t} lambda_{i,t} ]``, folded
  into token advantages ``adv[i, t] = c_g * delta_i * (A_i - gamma <H>_i) * lambda_{i,t} / n_conf_i^[divide_by_nconf]``
  for verl's vanilla loss with ``seq-mean-token-mean`` (per completion ``1/|o_i|``, then the mean over completions;
  ``ppo_epochs=1``: the ratio is 1 on-policy and the clip inactive).
- Conflict tokens (§6.2): the leading and trailing runs of (position, token) pairs that a positive and a negative
  completion of the group share (:mod:`gtpo.algorithms.conflict_tokens`); ``lambda`` is ``lam_pos`` (2) on a
  positive completion's run tokens, ``lam_neg`` (0) on a negative one's, 1 elsewhere.
- Entropy filter ``delta_i = 1[<H>_i <= tau]``, optionally gated by the initial model's entropy (the paper's 3-case
  ``delta``: filtering is on only when ``<H>_ini <= tau``), and the entropy penalty ``A'_i = delta_i (A_i - gamma
  <H>_i)`` (§6.3).
- The two behaviours of §6.5 through ``variant`` (``paper`` default, ``code``), which only sets defaults.

Deliberate choices and deviations (docs/ALGORITHMS.md §6.5-6.7):

1. ``n_conf`` is the union of the two runs (``nconf_count="union"``, default under ``variant=paper``) or the
   official code's ``max(f, b)`` (``"official"``, default under ``variant=code``).
2. ``<H>_ini`` (the ini gate) is the mean over the first batch's completions of ``<H>_i``; at ``<H>_ini == tau`` the
   filter is on. Measured on a run's first batch when ``h_ini`` is null and kept in the trainer's state (saved with
   each checkpoint); a resumed run without it raises rather than measure a trained policy's entropy as "initial".
3. Polarity comes from the *unshaped* advantage sign (as the official code); the centred advantage is float64 and a
   group whose rewards are all equal gets exactly 0; a row whose centred reward is within 1e-8 of 0 is inactive.
4. ``agg="code_sum"`` (the official code's sum over the G completions of its one-prompt steps) multiplies each
   completion's advantage by its group's size, turning verl's batch mean into the mean over groups of group sums.
5. None of the official code's defects (§6.5 list) is reproduced: no reference-model pass, no pad-id heuristic.
6. ``skip_zero_adv_groups`` zeroes a group whose rewards are all equal (the paper's "no update"); off
   (``variant=code``) such a group keeps ``-gamma <H>_i`` (the code's push-down).
7. A NaN or inf entropy on a valid token raises (padding may hold anything); the official code would propagate it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from gtpo.algorithms.conflict_tokens import NCONF_COUNTS, Runs, check_conflict_inputs, conflict_runs, scale_runs
from gtpo.algorithms.gaps import MaskGaps
from gtpo.algorithms.group_ops import group_mean_std, per_row, segment_sum
from gtpo.algorithms.gtpo_token import check_token_values
from gtpo.algorithms.kernel_dispatch import kernel_guard, kernel_on
from gtpo.algorithms.token_positions import has_gaps, position_layout

__all__ = [
    "GTPOTrajOutput",
    "GTPOTrajParams",
    "centred_advantages",
    "entropy_filter",
    "gtpo_traj_advantages",
    "gtpo_traj_definition",
    "trajectory",
]

LN2 = math.log(2.0)
VARIANTS = ("paper", "code")
ADV_NORMS = ("std", "none")
AGGS = ("paper_mean", "code_sum")
# Readings of "position" for the conflict runs (gtpo.algorithms.token_positions); per turn would put runs in the middle
# of a completion, which paper B's conflicts are not (docs/ALGORITHMS.md §6.2 point 5, §13).
TRAJ_POSITIONS = ("model", "raw")
# Defaults each variant gives to the knobs left at None (docs/ALGORITHMS.md §6.5 table).
VARIANT_DEFAULTS = {
    "paper": {
        "adv_norm": "std",
        "use_ini_gate": True,
        "tau": LN2,
        "divide_by_nconf": False,
        "nconf_count": "union",
        "agg": "paper_mean",
        "skip_zero_adv_groups": True,
    },
    "code": {
        "adv_norm": "none",
        "use_ini_gate": False,
        "tau": 0.7,
        "divide_by_nconf": True,
        "nconf_count": "official",
        "agg": "code_sum",
        "skip_zero_adv_groups": False,
    },
}


@dataclasses.dataclass(frozen=True)
class GTPOTrajParams:
    """``algorithm.gtpo_traj`` (docs/ALGORITHMS.md §6.5-6.7, §11).

    Fields left at ``None`` take the default of ``variant`` (:data:`VARIANT_DEFAULTS`); an explicit value always
    wins. After construction every field holds a concrete value.

    ``position`` says where a token sits for the conflict runs when tool tokens are inside a response (multi-turn
    tool use, docs/ALGORITHMS.md §13): ``model`` (the runs compare the model's own tokens in order and pass over a
    tool output) or ``raw`` (columns; a run ends at the first tool token). ``<H>_i`` and the filter average over the
    model's tokens under both.
    """

    variant: str = "paper"
    lam_pos: float = 2.0
    lam_neg: float = 0.0
    gamma: float = 0.1
    tau: float | None = None
    use_ini_gate: bool | None = None
    h_ini: float | None = None
    adv_norm: str | None = None
    divide_by_nconf: bool | None = None
    nconf_count: str | None = None
    agg: str | None = None
    skip_zero_adv_groups: bool | None = None
    eps: float = 1e-6
    position: str = "model"

    def __post_init__(self) -> None:
        if self.position not in TRAJ_POSITIONS:
            raise ValueError(f"position={self.position!r}: must be one of {list(TRAJ_POSITIONS)}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r}: must be one of {list(VARIANTS)}")
        for name, value in VARIANT_DEFAULTS[self.variant].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in ("lam_pos", "lam_neg", "gamma", "tau", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}={value!r}: must be a number")
            object.__setattr__(self, name, float(value))
        for name in ("lam_pos", "lam_neg", "gamma"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}={getattr(self, name)}: must be a finite number >= 0")
        if math.isnan(self.tau) or self.tau < 0:
            raise ValueError(f"tau={self.tau}: must be >= 0 (use .inf to disable the entropy filter)")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps={self.eps}: must be a finite number > 0")
        for name in ("use_ini_gate", "divide_by_nconf", "skip_zero_adv_groups"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be true or false")
        for name, choices in (("adv_norm", ADV_NORMS), ("nconf_count", NCONF_COUNTS), ("agg", AGGS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be one of {list(choices)}")
        if self.h_ini is not None:
            if isinstance(self.h_ini, bool) or not isinstance(self.h_ini, (int, float)):
                raise ValueError(f"h_ini={self.h_ini!r}: must be a number or null")
            if not (math.isfinite(self.h_ini) and self.h_ini >= 0):
                raise ValueError(f"h_ini={self.h_ini}: must be a finite entropy >= 0 (nats) or null")
            object.__setattr__(self, "h_ini", float(self.h_ini))


class GTPOTrajOutput(NamedTuple):
    """Result of :func:`trajectory` (all tensors detached)."""

    advantages: torch.Tensor  # [B, L] float32, zero on padding
    adv_seq: torch.Tensor  # [B] float32, A_i (unshaped, after adv_norm)
    shaped_seq: torch.Tensor  # [B] float32, A'_i = delta_i (A_i - gamma <H>_i), after group skipping and agg scale
    mean_entropy: torch.Tensor  # [B] float32, <H>_i
    delta: torch.Tensor  # [B] float32 in {0, 1}
    polarity: torch.Tensor  # [B] int8
    n_conf: torch.Tensor  # [B] int64 divisor (>= 1)
    runs: Runs  # the conflict runs of each row
    lam_c: torch.Tensor  # [B] float32 weight of the row's conflict tokens (lam_pos / lam_neg; 1 if inactive)
    response_mask: torch.Tensor  # [B, L] the mask the runs refer to
    h_ini: float | None  # <H>_ini used (measured on this batch with measure_h_ini)
    metrics: dict

    @property
    def is_conflict(self) -> torch.Tensor:
        """``[B, L]`` bool: tokens of the leading (forward) or trailing (backward, right-aligned) run."""
        marks = torch.ones(self.response_mask.shape, dtype=torch.float32, device=self.response_mask.device)
        scale_runs(marks, self.runs, torch.zeros_like(self.lam_c))
        return marks == 0

    @property
    def lam(self) -> torch.Tensor:
        """``[B, L]`` float32 ``lambda_fwd * lambda_bwd * m`` (``lam_c`` per run, ``lam_c ** 2`` in both)."""
        lam = self.response_mask.to(torch.float32).clone()
        scale_runs(lam, self.runs, self.lam_c)
        return lam


@torch.no_grad()
def gtpo_traj_advantages(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GTPOTrajParams | None = None,
    responses: torch.Tensor | None = None,
    state: dict | None = None,
    global_steps: int | None = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GTPO-trajectory advantages and diagnostics (the estimator contract of
    :func:`gtpo.algorithms.gtpo_token.gtpo_token_advantages`; ``responses`` required, ``reward_offset`` unused).

    ``state`` is the trainer's ``gtpo_traj`` block of its cross-step state: with the ini gate on and ``h_ini`` null,
    the first call measures ``<H>_ini`` on its batch and writes ``state["h_ini"]``, where later calls read it. None:
    measured on this batch, kept nowhere. ``global_steps > 1`` with nothing measured (a checkpoint without the
    recipe's state) raises and asks for ``algorithm.gtpo_traj.h_ini``.
    """
    params = params or GTPOTrajParams()
    h_ini, measure = params.h_ini, False
    if params.use_ini_gate and h_ini is None:
        h_ini = state.get("h_ini") if state is not None else None
        if h_ini is None:
            if global_steps is not None and int(global_steps) > 1:
                raise ValueError(
                    f"algorithm.gtpo_traj.h_ini=null on a resumed run (global_steps={int(global_steps)}) whose "
                    "checkpoint holds no measured value (no gtpo_state.json): the ini gate needs the initial model's "
                    "entropy; set algorithm.gtpo_traj.h_ini to the gtpo_traj/h_ini value logged at step 1 "
                    "(or use_ini_gate=false)"
                )
            measure = True
    inputs = (rewards, response_mask, responses, entropy, gid, num_groups, params, h_ini)
    layout = None
    try:
        out = trajectory(*inputs, measure_h_ini=measure, refuse_gaps=params.position != "raw")
    except MaskGaps:  # tool tokens inside the responses: the runs read the model's tokens in order
        layout = position_layout(response_mask, params.position, gaps=True)
        gathered = (layout.gather(response_mask), layout.gather(responses), layout.gather(entropy))
        out = trajectory(rewards, *gathered, gid, num_groups, params, h_ini, measure_h_ini=measure)
    if measure and state is not None:
        state["h_ini"] = float(out.h_ini)
    return (out.advantages if layout is None else layout.scatter(out.advantages)), out.metrics


@torch.no_grad()
def centred_advantages(
    scores: torch.Tensor, gid: torch.Tensor, num_groups: int, adv_norm: str, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A [B] float32, polarity [B] int8, zero_var [B] bool)``: the group-relative advantage, its sign, and the rows
    of groups whose rewards are all equal (``A = 0`` exactly, polarity 0 there).

    ``adv_norm="none"``: ``A = r - mean_g(r)`` (official code); ``"std"``: ``(r - mean_g(r)) / (std_g(r) + eps)``,
    unbiased std (verl's GRPO convention; a group of one row has std 0).
    """
    if adv_norm not in ADV_NORMS:
        raise ValueError(f"adv_norm={adv_norm!r}: must be one of {list(ADV_NORMS)}")
    r = scores.to(torch.float64)
    mean, std, _ = group_mean_std(r, gid, num_groups, unbiased=True)
    gmax = torch.full((num_groups,), -math.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, gid, r, "amax")
    gmin = torch.full((num_groups,), math.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, gid, r, "amin")
    zero_var = per_row(gmax == gmin, gid)
    centred = torch.where(zero_var, 0.0, r - per_row(mean, gid))
    centred = torch.where(centred.abs() <= 1e-8, 0.0, centred)
    polarity = torch.sign(centred).to(torch.int8)
    adv = centred / (per_row(std, gid) + eps) if adv_norm == "std" else centred
    return adv.to(torch.float32), polarity, zero_var


@torch.no_grad()
def entropy_filter(mean_entropy: torch.Tensor, tau: float, use_ini_gate: bool, h_ini: float | None) -> torch.Tensor:
    """``delta_i`` (§6.1 / §6.3), ``[B]`` float32 in {0, 1}: kept when ``<H>_i <= tau`` (``inf`` disables the filter);
    under the ini gate every completion is kept when ``<H>_ini > tau``."""
    if use_ini_gate:
        if h_ini is None:
            raise ValueError("h_ini=None: the ini gate needs the initial model's mean entropy")
        if h_ini > tau:
            return torch.ones_like(mean_entropy, dtype=torch.float32)
    return (mean_entropy <= tau).to(torch.float32)


@torch.no_grad()
def trajectory(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    responses: torch.Tensor,
    entropy: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GTPOTrajParams,
    h_ini: float | None = None,
    *,
    measure_h_ini: bool = False,
    refuse_gaps: bool = False,
) -> GTPOTrajOutput:
    """Token-level GTPO-trajectory advantages with every intermediate (docs/ALGORITHMS.md §6.6).

    Args:
        scores: ``[B]`` sequence rewards. response_mask: ``[B, L]`` 0/1. responses: ``[B, L]`` integer token ids.
        entropy: ``[B, L]`` per-token entropy (detached; NaN / inf on a valid token raise, padding never read).
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. params: resolved :class:`GTPOTrajParams`.
        h_ini: ``<H>_ini`` of the ini gate (overrides ``params.h_ini``; required when the gate is on, unless
            ``measure_h_ini``, which takes this batch's mean over completions of ``<H>_i``).
        refuse_gaps: raise :class:`gtpo.algorithms.gaps.MaskGaps` when a row's valid tokens are not one
            block from column 0 (the entry point then runs on its ``position``'s layout); otherwise masked tokens
            inside a row are holes of the columns (``position=raw``).
    """
    if not isinstance(entropy, torch.Tensor) or entropy.shape != response_mask.shape:
        raise ValueError(
            f"entropy shape {getattr(entropy, 'shape', None)} != response_mask {tuple(response_mask.shape)}"
        )
    if scores.shape != (response_mask.shape[0],):
        raise ValueError(f"scores must be [B]={response_mask.shape[0]}, got {tuple(scores.shape)}")
    h_ini = params.h_ini if h_ini is None else h_ini
    if params.use_ini_gate and h_ini is None and not measure_h_ini:
        raise ValueError("h_ini=None: the ini gate needs the initial model's mean entropy")
    gid = gid.to(device=response_mask.device, dtype=torch.long)
    adv, polarity, zero_var = centred_advantages(scores, gid, num_groups, params.adv_norm, params.eps)
    check_conflict_inputs(responses, response_mask, gid, num_groups, polarity)
    if all(t.device.type == "cpu" for t in (response_mask, responses, entropy)) and kernel_on("gtpo_traj"):
        with kernel_guard("gtpo_traj"):  # numba missing or failing: the definition below
            from gtpo.algorithms import kernels

            try:
                fields, h_ini, metrics = kernels.gtpo_traj_kernel(
                    response_mask, responses, entropy, gid.cpu(), num_groups, params, adv, polarity, zero_var, h_ini,
                    refuse_gaps,
                )  # fmt: skip
            except kernels.BadValues:  # the check below names the problem
                fields = None
        if fields is not None:
            runs = Runs(fields.pop("run_fwd"), fields.pop("run_bwd"), fields.pop("last"))
            return GTPOTrajOutput(adv_seq=adv, polarity=polarity, runs=runs, response_mask=response_mask,
                                  h_ini=h_ini, metrics=metrics, **fields)  # fmt: skip
    if refuse_gaps and has_gaps(response_mask):
        raise MaskGaps
    check_token_values(entropy, response_mask)
    return gtpo_traj_definition(response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var,
                                h_ini)  # fmt: skip


@torch.no_grad()
def gtpo_traj_definition(response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var, h_ini):
    """:func:`trajectory` after the group advantages, in torch (inputs validated): ``<H>_i``, ``delta_i``,
    ``A'_i``, the conflict runs, and the token advantages ``A'_i lambda_{i,t} / n_conf_i^[divide_by_nconf]``."""
    valid = response_mask.bool()
    lengths = valid.sum(-1).to(torch.float64)
    entropy_sum = torch.where(valid, entropy.detach().to(torch.float64), 0.0).sum(-1)
    h_bar = (entropy_sum / lengths.clamp(min=1)).to(torch.float32)
    valid_rows = lengths > 0
    if params.use_ini_gate and h_ini is None:
        h_ini = float(h_bar[valid_rows].mean()) if bool(valid_rows.any()) else 0.0
    delta = entropy_filter(h_bar, params.tau, params.use_ini_gate, h_ini)

    # A'_i = delta_i (A_i - gamma <H>_i), per completion; then the conflict weights per token
    runs = conflict_runs(responses, response_mask, gid, num_groups, polarity)
    n_conf = runs.n_conf(polarity, params.nconf_count)
    lam_c = torch.where(polarity > 0, params.lam_pos, params.lam_neg).to(torch.float32)
    lam_c = torch.where(polarity == 0, 1.0, lam_c)
    shaped = delta * (adv - params.gamma * h_bar)
    if params.skip_zero_adv_groups:
        shaped = torch.where(zero_var, 0.0, shaped)
    if params.agg == "code_sum":
        shaped = shaped * segment_sum(torch.ones_like(shaped), gid, num_groups)[gid]
    row_scale = shaped / n_conf.to(torch.float32) if params.divide_by_nconf else shaped
    advantages = valid.to(torch.float32) * row_scale[:, None]
    scale_runs(advantages, runs, lam_c)
    n_rows, n_tok = max(int(valid_rows.sum()), 1), max(float(lengths.sum()), 1.0)
    n_conflict, overlap = runs.conflict_tokens().to(torch.float64), runs.overlap().to(torch.float64)
    active = polarity != 0
    # sum_t lambda per row: lam_c on single-run tokens, lam_c ** 2 on tokens of both runs, 1 elsewhere
    lam64 = lam_c.to(torch.float64)
    lam_row = lengths - n_conflict + lam64 * (n_conflict - overlap) + lam64**2 * overlap
    metrics = {
        "conflict_token_frac": float(n_conflict.sum()) / n_tok,
        "pos_conflict_token_frac": float(n_conflict[polarity > 0].sum()) / n_tok,
        "neg_conflict_token_frac": float(n_conflict[polarity < 0].sum()) / n_tok,
        "conflict_traj_frac": float(((n_conflict > 0) & valid_rows).sum()) / n_rows,
        "filtered_traj_frac": float(((delta == 0) & valid_rows).sum()) / n_rows,
        "active_traj_frac": float((active & valid_rows).sum()) / n_rows,
        "zero_var_traj_frac": float((zero_var & valid_rows).sum()) / n_rows,
        "mean_entropy": float(h_bar[valid_rows].mean()) if bool(valid_rows.any()) else 0.0,
        "shaped_adv_mean": float(shaped[valid_rows].mean()) if bool(valid_rows.any()) else 0.0,
        "adv_abs_mean": float((row_scale.abs().to(torch.float64) * lam_row).sum()) / n_tok,
        "filter_on": float(not (params.use_ini_gate and h_ini is not None and h_ini > params.tau)),
    }
    if h_ini is not None:
        metrics["h_ini"] = float(h_ini)
    return GTPOTrajOutput(
        advantages=advantages,
        adv_seq=adv,
        shaped_seq=shaped,
        mean_entropy=h_bar,
        delta=delta,
        polarity=polarity,
        n_conf=n_conf,
        runs=runs,
        lam_c=lam_c,
        response_mask=response_mask,
        h_ini=h_ini,
        metrics=metrics,
    )
