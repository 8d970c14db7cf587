"""The recipe's trainer modes by name (``trainer.v1.trainer_mode``) and the verl mode each one's base class runs as.

A table without the trainers: the launch checks read it before Ray starts, while importing :mod:`gtpo.trainer.modes`
registers the trainers into verl (only :mod:`gtpo.verl_plugin.register` does).
"""

from __future__ import annotations

__all__ = ["TRAINER_MODES"]

TRAINER_MODES: dict[str, str] = {
    "gtpo_sync": "sync",
    "gtpo_colocate_async": "colocate_async",
    "gtpo_separate_async": "separate_async",
}
