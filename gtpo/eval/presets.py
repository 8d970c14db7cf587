"""Named sampling presets shared by in-loop validation (``configs/sampling/<name>.yaml``) and offline evaluation.

* ``paper``: T = 1.0, top-p = 1.0 (paper A, arXiv 2508.04349, Sec. 3.1; Table 1's Mean@32 / Pass@4 / Pass@32).
* ``dapo``:  T = 1.0, top-p = 0.7 (DAPO, arXiv 2503.14476; avg@32 on AIME).
* ``r1``:    T = 0.6, top-p = 0.95 (DeepSeek-R1, arXiv 2501.12948; open-r1 / lighteval).

All draw n = 32 samples per problem so that pass@k is reported for k <= 32. The YAML files state the same
values (a test keeps them equal); ``hydra_overrides`` gives the command-line form.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["SAMPLING_PRESETS", "SamplingPreset", "get_preset", "hydra_overrides"]


@dataclass(frozen=True)
class SamplingPreset:
    """Sampling parameters of one named preset (vLLM / verl ``val_kwargs`` names)."""

    name: str
    temperature: float
    top_p: float
    n: int
    do_sample: bool = True
    top_k: int = -1
    reference: str = ""

    def val_kwargs(self) -> dict:
        """The ``actor_rollout_ref.rollout.val_kwargs`` fields this preset sets."""
        return {"temperature": self.temperature, "top_p": self.top_p, "do_sample": self.do_sample, "n": self.n}

    def as_dict(self) -> dict:
        return asdict(self)


SAMPLING_PRESETS: dict[str, SamplingPreset] = {
    "paper": SamplingPreset("paper", temperature=1.0, top_p=1.0, n=32, reference="paper A, arXiv 2508.04349, Sec. 3.1"),
    "dapo": SamplingPreset("dapo", temperature=1.0, top_p=0.7, n=32, reference="DAPO, arXiv 2503.14476"),
    "r1": SamplingPreset("r1", temperature=0.6, top_p=0.95, n=32, reference="DeepSeek-R1, arXiv 2501.12948"),
}


def get_preset(name: str) -> SamplingPreset:
    if name not in SAMPLING_PRESETS:
        raise ValueError(f"sampling preset {name!r}: expected one of {sorted(SAMPLING_PRESETS)}")
    return SAMPLING_PRESETS[name]


def hydra_overrides(name: str) -> list[str]:
    """verl command-line overrides equivalent to ``sampling=<name>``."""
    return [f"actor_rollout_ref.rollout.val_kwargs.{k}={v}" for k, v in get_preset(name).val_kwargs().items()]
