"""Typed, validated knob blocks: ``algorithm.gtpo``, ``algorithm.gtpo_traj``, ``algorithm.watchdog`` ...

Each block has a frozen dataclass whose ``__post_init__`` raises ``ValueError("<field>=<value>: <why>")`` (the
estimators' in ``gtpo.algorithms``, the trainer's beside the code that reads them). :func:`load_knobs` turns a config
node (an OmegaConf ``DictConfig`` or a plain mapping) into that dataclass and prefixes every error with the full key,
so a bad value fails at startup as ``algorithm.gtpo.alpha2=-1: must be >= 0`` before Ray or any GPU is touched.

It sits below the adapters verl calls (``gtpo.verl_plugin``), the trainer's runtime (``gtpo.trainer``) and the launch
tooling (``gtpo.launch``), which all read knobs, and imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["load_knobs", "to_plain"]


def to_plain(node: Any) -> Any:
    """An OmegaConf node (or anything mapping-like) as plain Python containers; other values unchanged."""
    if node is None:
        return {}
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(node, (DictConfig, ListConfig)):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a hard dependency of verl
        pass
    if isinstance(node, Mapping):
        return dict(node)
    return node


def load_knobs(cls: type[T], node: Any, prefix: str) -> T:
    """Build the frozen dataclass ``cls`` from ``node``; unknown keys and invalid values raise with the key named.

    Args:
        cls: a dataclass type whose ``__post_init__`` validates its fields.
        node: ``DictConfig``, mapping or None (None means all defaults).
        prefix: the config path of the block, e.g. ``"algorithm.gtpo"``, used in error messages.

    Returns:
        An instance of ``cls``.

    Raises:
        ValueError: naming ``<prefix>.<key>`` for unknown keys, wrong types or invalid values.
    """
    values = to_plain(node)
    if not isinstance(values, Mapping):
        raise ValueError(f"{prefix} must be a mapping of knobs, got {type(values).__name__}: {values!r}")
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(f'{prefix}.{k}' for k in unknown)}; valid keys: {sorted(names)}")
    kwargs = {k: v for k, v in values.items() if k in names}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{prefix}.{err}") from None
