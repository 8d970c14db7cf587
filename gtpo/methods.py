"""The recipe's methods, one row each, and the knob blocks they and the trainer read.

``method=<name>`` composes ``configs/method/<name>.yaml``; its row says what that trains and what it needs. Every
list of methods is read from :data:`METHODS`: what is registered into verl (:mod:`gtpo.verl_plugin.register`), what
the trainer fetches from the batch for an estimator (:func:`fields_needed`), the launch checks (GROP, groups,
rollout correction's bypass mode), the launchers' method names, the CPU comparison and the tests.

Add a method: its estimator file (knobs, definition, entry point, as :mod:`gtpo.algorithms.gtpo_token`), a row here,
and its preset ``configs/method/<name>.yaml`` (docs/architecture.md, "Add a method"). A row added from elsewhere
(:func:`add`; a test's toy method) is registered the same way.

Every knob block under ``algorithm.*`` is in :data:`KNOBS` (block -> its dataclass) and read through one loader,
:func:`knob`, whose errors name the key (``algorithm.gtpo.alpha2=-1: must be >= 0``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from gtpo.algorithms.grpo_s import GRPOSParams, grpo_s_advantages, grpo_s_policy_loss
from gtpo.algorithms.gtpo_token import GTPOParams, gtpo_token_advantages
from gtpo.algorithms.gtpo_traj import GTPOTrajParams, gtpo_traj_advantages
from gtpo.algorithms.length_penalty import GROPParams
from gtpo.algorithms.token_selection import ForkingParams
from gtpo.knobs import GroupParams, HardwareParams, PreemptionParams, ResumeParams, WatchdogParams, load_knobs

__all__ = [
    "ENTROPY",
    "FIELDS",
    "KNOBS",
    "METHODS",
    "RESPONSES",
    "Method",
    "add",
    "entropy_available",
    "fields_needed",
    "knob",
    "method_named",
    "recipe_estimator",
]

# What an estimator can need from the batch beyond verl's own arguments, and the TransferQueue field each is read
# from: the old policy's per-token entropy (verl's old-log-prob pass) and the response token ids. Another entropy
# source (docs/architecture.md, "Change the entropy source") changes this mapping and nothing else.
ENTROPY = "entropy"
RESPONSES = "responses"
FIELDS: dict[str, str] = {ENTROPY: "entropy", RESPONSES: "responses"}


@dataclass(frozen=True)
class Method:
    """One row of the table: a ``method=`` preset and what it trains.

    Attributes:
        name: the preset's name (``configs/method/<name>.yaml``), used in launcher and run names.
        paper: where the method comes from.
        adv_estimator: the ``algorithm.adv_estimator`` the preset selects.
        advantages: the recipe's estimator (:func:`gtpo.algorithms.gtpo_token.gtpo_token_advantages`' contract),
            registered into verl under ``adv_estimator``; None: verl's own estimator runs unchanged.
        knobs: the ``algorithm.<knobs>`` block the method reads (None: none of the recipe's).
        params: that block's dataclass.
        needs: what the trainer hands the estimator from the batch (:data:`FIELDS`).
        applies_grop: the estimator adds GROP's length penalty (``algorithm.grop``) to its rewards itself.
        grouped: advantages are relative to the prompt's group of ``rollout.n`` responses (n >= 2).
        stateful: the estimator keeps state across steps (its block of ``gtpo_state.json``).
        policy_loss: a policy loss registered into verl under ``name`` (``actor.policy_loss.loss_mode``).
        variants: named knob settings the CPU comparison runs (``python -m gtpo.cpu.compare``): suffix ->
            ``<key>=<value>`` overrides under ``algorithm.<knobs>``; none: the preset alone.
    """

    name: str
    paper: str
    adv_estimator: str
    advantages: Callable[..., Any] | None = None
    knobs: str | None = None
    params: type | None = None
    needs: tuple[str, ...] = ()
    applies_grop: bool = False
    grouped: bool = True
    stateful: bool = False
    policy_loss: Callable[..., Any] | None = None
    variants: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.needs) - set(FIELDS))
        if unknown:
            raise ValueError(f"method {self.name!r}: needs {unknown}; what the batch offers: {sorted(FIELDS)}")
        if (self.knobs is None) != (self.params is None):
            raise ValueError(f"method {self.name!r}: a knob block needs its dataclass, and a dataclass its block")


METHODS: dict[str, Method] = {}


def add(method: Method) -> Method:
    """Add a row to :data:`METHODS` (and its knob block to :data:`KNOBS`); a name already taken by another row, or a
    block by another dataclass, is refused."""
    taken = METHODS.get(method.name)
    if taken is not None and taken != method:
        raise ValueError(f"method {method.name!r} is already a row of gtpo.methods.METHODS")
    for row in METHODS.values():
        if row.name != method.name and row.advantages is not None and row.adv_estimator == method.adv_estimator:
            if method.advantages is not None and method.advantages is not row.advantages:
                raise ValueError(f"method {method.name!r}: estimator {method.adv_estimator!r} is {row.name!r}'s")
    if method.knobs is not None:
        if KNOBS.get(method.knobs, method.params) is not method.params:
            raise ValueError(f"method {method.name!r}: algorithm.{method.knobs} is read by another dataclass")
        KNOBS[method.knobs] = method.params
    METHODS[method.name] = method
    return method


# Knob blocks under algorithm.* that no method row owns: GROP (read by the estimators that apply it) and the
# trainer's own (group sizes, stage deadlines, preemption, resume at another world size, the GPUs a run is sized for).
KNOBS: dict[str, type] = {
    "grop": GROPParams,
    "groups": GroupParams,
    "watchdog": WatchdogParams,
    "preemption": PreemptionParams,
    "resume": ResumeParams,
    "hardware": HardwareParams,
}

add(Method("grpo", "DeepSeekMath, arXiv 2402.03300", adv_estimator="grpo"))
add(Method("dapo", "DAPO, arXiv 2503.14476", adv_estimator="grpo"))
add(
    Method(
        "dapo_forking",
        "Beyond the 80/20 Rule, arXiv 2506.01939",
        adv_estimator="grpo",
        knobs="forking",
        params=ForkingParams,
    )
)
add(
    Method(
        "gtpo",
        "Tan et al., arXiv 2508.04349",
        adv_estimator="gtpo",
        advantages=gtpo_token_advantages,
        knobs="gtpo",
        params=GTPOParams,
        needs=(ENTROPY,),
        applies_grop=True,
        variants={
            "zero_fill": ("norm_mode=zero_fill",),
            "joint": ("norm_mode=joint",),
            "split": ("norm_mode=split",),
            "conflict_mask": ("conflict_mask=true",),
        },
    )
)
add(
    Method(
        "grpo_s",
        "Tan et al., arXiv 2508.04349",
        adv_estimator="grpo_s",
        advantages=grpo_s_advantages,
        knobs="grpo_s",
        params=GRPOSParams,
        needs=(ENTROPY,),
        applies_grop=True,
        policy_loss=grpo_s_policy_loss,
        variants={"zero_fill": ("norm_mode=zero_fill",), "joint": ("norm_mode=joint",)},
    )
)
add(
    Method(
        "gtpo_traj",
        "Simoni et al., arXiv 2508.03772",
        adv_estimator="gtpo_traj",
        advantages=gtpo_traj_advantages,
        knobs="gtpo_traj",
        params=GTPOTrajParams,
        needs=(ENTROPY, RESPONSES),
        stateful=True,
        variants={"paper": ("variant=paper",), "code": ("variant=code",)},
    )
)


def method_named(name: str) -> Method:
    """The row ``name``; an unknown name is refused with the valid ones."""
    if name not in METHODS:
        raise ValueError(f"method={name!r}: not a method of the recipe; valid: {', '.join(METHODS)}")
    return METHODS[name]


def recipe_estimator(adv_estimator: str) -> Method | None:
    """The row whose recipe estimator verl registers as ``adv_estimator``, or None (verl's own estimator)."""
    for row in METHODS.values():
        if row.advantages is not None and row.adv_estimator == adv_estimator:
            return row
    return None


def knob(algorithm: Any, block: str) -> Any:
    """``algorithm.<block>`` as its dataclass (defaults where the block is absent); errors name the key."""
    if block not in KNOBS:
        raise ValueError(f"algorithm.{block}: not a knob block of the recipe; valid: {', '.join(sorted(KNOBS))}")
    node = algorithm.get(block, None) if algorithm is not None else None
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    return load_knobs(KNOBS[block], node, f"algorithm.{block}")


def entropy_available(algorithm: Any) -> bool:
    """Whether verl computes the old policy's entropy for this config: its old-log-prob pass runs, unless rollout
    correction's ``bypass_mode`` skips it (then no method that needs :data:`ENTROPY` can run)."""
    rollout_correction = algorithm.get("rollout_correction", None) if algorithm is not None else None
    return not (rollout_correction and rollout_correction.get("bypass_mode", False))


def fields_needed(algorithm: Any) -> tuple[str, ...]:
    """What the trainer must fetch from the batch for this config (:data:`FIELDS` keys): the estimator row's needs,
    those its knobs add (a knob dataclass's ``needs``: GTPO's ``conflict_mask`` compares token ids), and those of the
    forking loss (its ``scope=batch`` quantile is taken over the old policy's entropy)."""
    row = recipe_estimator(str(algorithm.adv_estimator))
    needs = list(row.needs) + list(getattr(knob(algorithm, row.knobs), "needs", ())) if row is not None else []
    needs += knob(algorithm, "forking").needs
    return tuple(dict.fromkeys(needs))
