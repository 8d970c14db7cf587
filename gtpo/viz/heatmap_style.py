"""What both heatmap renderers share: the colour scale, the value each token shows, grouping and labels."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gtpo.viz.dump_reader import Response

__all__ = ["ADVANTAGE_CMAP", "COLOR_MODES", "ENTROPY_CMAP", "ColorScale"]

ADVANTAGE_CMAP = "RdBu"
ENTROPY_CMAP = "YlOrRd"
COLOR_MODES = ("advantage", "entropy", "score", "none")


@dataclass(frozen=True)
class ColorScale:
    """Value -> RGBA mapping. ``advantage``/``score``: symmetric diverging; ``entropy``: sequential from 0."""

    mode: str
    vmin: float
    vmax: float

    @property
    def cmap_name(self) -> str | None:
        return {"advantage": ADVANTAGE_CMAP, "score": ADVANTAGE_CMAP, "entropy": ENTROPY_CMAP}.get(self.mode)

    @classmethod
    def fit(cls, mode: str, values: Sequence[np.ndarray], vmax: float | None = None) -> ColorScale:
        """Scale over all rendered values (so colours compare across responses); ``vmax`` overrides it."""
        if mode not in COLOR_MODES:
            raise ValueError(f"color={mode!r}: expected one of {COLOR_MODES}")
        if vmax is not None and not (vmax > 0 and math.isfinite(vmax)):
            raise ValueError(f"vmax={vmax}: must be a positive finite number")
        flat = np.concatenate([np.asarray(v, dtype=np.float64) for v in values]) if values else np.zeros(0)
        flat = flat[np.isfinite(flat)]
        if mode == "entropy":
            top = vmax if vmax is not None else (float(flat.max()) if flat.size else 0.0)
            return cls(mode, 0.0, top if top > 0 else 1.0)
        top = vmax if vmax is not None else (float(np.abs(flat).max()) if flat.size else 0.0)
        top = top if top > 0 else 1.0  # all zeros: any scale draws white
        return cls(mode, -top, top)

    def normalize(self, values: np.ndarray) -> np.ndarray:
        """Values -> ``[0, 1]`` colormap positions (clipped); 0 maps to 0.5 on diverging scales."""
        v = np.asarray(values, dtype=np.float64)
        return np.clip((v - self.vmin) / (self.vmax - self.vmin), 0.0, 1.0)

    def rgba(self, values: np.ndarray) -> np.ndarray:
        """``[T]`` values -> ``[T, 4]`` RGBA floats; NaN (missing) and mode ``none`` -> white."""
        v = np.asarray(values, dtype=np.float64)
        out = np.ones((v.shape[0], 4))
        if self.cmap_name is None:
            return out
        from matplotlib import colormaps

        ok = np.isfinite(v)
        out[ok] = colormaps[self.cmap_name](self.normalize(v[ok]))
        return out


def hex_colors(rgba: np.ndarray) -> list[str]:
    rgb = np.clip(np.rint(np.asarray(rgba)[:, :3] * 255), 0, 255).astype(int)
    return [f"#{r:02x}{g:02x}{b:02x}" for r, g, b in rgb]


def text_is_dark(rgba: np.ndarray) -> np.ndarray:
    """Dark text on light boxes (relative luminance > 0.5)."""
    lum = 0.2126 * rgba[:, 0] + 0.7152 * rgba[:, 1] + 0.0722 * rgba[:, 2]
    return lum > 0.5


def token_values(resp: Response, mode: str) -> np.ndarray | None:
    n = len(resp.tokens)
    if mode == "advantage":
        return resp.advantages
    if mode == "entropy":
        return resp.entropy
    if mode == "score":
        return None if resp.score is None else np.full(n, resp.score)
    return np.full(n, math.nan)


def check_mode(responses: Sequence[Response], mode: str) -> None:
    if mode not in COLOR_MODES:
        raise ValueError(f"color={mode!r}: expected one of {COLOR_MODES}")
    field = {"advantage": "advantages", "entropy": "entropy", "score": "score"}.get(mode)
    for r in responses:
        if field is not None and token_values(r, mode) is None:
            raise ValueError(
                f"color={mode}: response {r.key or r.uid} has no '{field}' (verl's rollout dumps are text only: "
                "use --color score or --color none, or write token dumps with gtpo.viz.tokens.token_records)"
            )


# --------------------------------------------------------------------------------------------------------------
# Grouping
# --------------------------------------------------------------------------------------------------------------


def columns(group: list[Response]) -> list[tuple[str, list[Response]]]:
    cols = [
        ("correct", [r for r in group if r.correct is True]),
        ("incorrect", [r for r in group if r.correct is False]),
    ]
    ungraded = [r for r in group if r.correct is None]
    if ungraded:
        cols.append(("ungraded", ungraded))
    return cols


def group_by_prompt(responses: Sequence[Response], max_prompts: int | None) -> list[list[Response]]:
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts={max_prompts}: must be >= 1 or None")
    groups: dict[str, list[Response]] = {}
    for r in responses:
        groups.setdefault(r.uid, []).append(r)
    return list(groups.values())[:max_prompts]


def mode_label(mode: str) -> str:
    return {"advantage": "advantage", "entropy": "entropy", "score": "score", "none": "token"}[mode]


def fmt_value(v: float) -> str:
    return "nan" if not math.isfinite(v) else repr(float(v))


def response_meta(r: Response) -> str:
    parts = [f"{len(r.tokens)} tokens"]
    if r.score is not None:
        parts.append(f"score={r.score:g}")
    if r.acc is not None:
        parts.append(f"acc={r.acc}")
    if r.advantages is not None and len(r.advantages):
        parts.append(f"mean adv={np.nanmean(r.advantages):+.4g}")
    if r.entropy is not None and len(r.entropy):
        parts.append(f"mean H={np.nanmean(r.entropy):.4g}")
    if r.key:
        parts.append(r.key)
    return " · ".join(parts)
