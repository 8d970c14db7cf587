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


def data_overrides(folder: Path) -> list[str]:
    """``data.train_files`` / ``data.val_files`` of a tiny dataset in ``folder`` that the driver's data checks accept
    (gtpo/launch/data_checks.py): what a real run's ``prepare_config`` reads before Ray starts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = {
        "data_source": ["toy"] * 4,
        "prompt": [[{"role": "user", "content": f"say {i}"}] for i in range(4)],
        "reward_model": [{"style": "rule", "ground_truth": str(i)} for i in range(4)],
    }
    for name in ("train", "val"):
        pq.write_table(pa.table(rows), folder / f"{name}.parquet")
    return [f"data.train_files={folder / 'train.parquet'}", f"data.val_files={folder / 'val.parquet'}"]
