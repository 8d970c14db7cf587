"""The recipe's Hydra config (recipe/gtpo/config/gtpo_trainer.yaml) composed in-process, as the entry point does."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "recipe" / "gtpo" / "config"


def compose(overrides: list[str]):
    """``gtpo_trainer`` with ``overrides``, composed from the repository root (the search path ``file://configs`` is
    relative to the working directory)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    old_cwd = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return hydra_compose(config_name="gtpo_trainer", overrides=overrides)
    finally:
        os.chdir(old_cwd)
