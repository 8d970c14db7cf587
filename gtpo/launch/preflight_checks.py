"""Preflight checks 1-8 (:mod:`gtpo.launch.preflight`): what the composed config, the data, the model and this
machine say, each a short function returning its ``ok`` line or raising :class:`PreflightError`.

``config`` (the recipe's validation and the whole dry run), ``overlong buffer``, ``train data`` / ``val data``,
``run length``, ``model``, ``trackers`` (and the ``warn`` lines of relative log folders), and who may write into the
checkpoint folder (:func:`check_checkpoint_dir`). The checkpoint cadence and folder are two lines of
:func:`gtpo.launch.preflight.run_preflight` itself; the cluster's checks (9-12) are
:mod:`gtpo.launch.preflight_cluster`.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gtpo.private_files import check_private_dir, check_unswappable_parents

__all__ = ["PreflightError", "as_list", "check_checkpoint_dir", "check_config", "check_model", "check_overlong",
           "check_data_files", "check_run_length", "check_trackers", "log_dir_warnings",
           "parquet_rows", "weights_problem"]  # fmt: skip


class PreflightError(Exception):
    """A failed check: ``item`` names it, the message says what is wrong and with which value."""

    def __init__(self, item: str, message: str):
        super().__init__(f"{item}: {message}")
        self.item = item


def as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def check_config(cfg: DictConfig, env: dict[str, str]) -> str:
    """Every check the entry point runs before Ray (:func:`gtpo.launch.checks.check_config`) and the checkpoint
    engine's transport in this image; the line is the run's shape."""
    from gtpo.launch.checks import check_checkpoint_engine
    from gtpo.launch.checks import check_config as check_before_ray
    from gtpo.launch.runs import facts

    try:
        checked = check_before_ray(cfg, env)
        check_checkpoint_engine(checked.config)
    except ValueError as err:
        raise PreflightError("config", str(err)) from None
    plan = checked.plan
    return (
        f"{facts(checked.config)}; ulysses sp={plan['sp']} -> dp={plan['dp']}, vLLM replicas={plan['rollout_replicas']}"
    )


def check_overlong(cfg: DictConfig) -> str:
    from gtpo.launch.checks import check_overlong_shaping

    buffer = OmegaConf.select(cfg, "reward.reward_kwargs.overlong_buffer_cfg")
    if not buffer or not buffer.get("enable", False):
        return "soft overlong punishment off"
    try:
        check_overlong_shaping(cfg)
    except ValueError as err:
        raise PreflightError("overlong buffer", str(err)) from None
    return f"len={buffer.get('len')} < max_resp_len={OmegaConf.select(cfg, 'reward.reward_kwargs.max_resp_len')}"


def parquet_rows(files: list[str]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(path).metadata.num_rows for path in files)


def check_run_length(cfg: DictConfig, rows: int) -> str:
    """verl runs min(total_epochs x (rows // train_batch_size), total_training_steps) steps."""
    batch, epochs = int(cfg.data.train_batch_size), int(cfg.trainer.total_epochs)
    steps = cfg.trainer.get("total_training_steps", None)
    cap = int(cfg.data.get("train_max_samples", -1) or -1)
    rows = min(rows, cap) if cap > 0 else rows
    per_epoch = rows // batch
    if per_epoch == 0:
        raise PreflightError(
            "run length", f"data.train_files hold {rows} prompts < data.train_batch_size={batch}: no training step"
        )
    if steps is None:
        return f"trainer.total_epochs={epochs} x {per_epoch} steps per epoch = {epochs * per_epoch} steps"
    if epochs * per_epoch < int(steps):
        raise PreflightError(
            "run length",
            f"trainer.total_training_steps={steps} but trainer.total_epochs={epochs} x {rows} // {batch} = "
            f"{epochs * per_epoch} steps: verl stops at the first of the two, and without the last step's checkpoint "
            f"and validation; raise trainer.total_epochs to at least {-(-int(steps) // per_epoch)} (or drop the "
            "override)",
        )
    return f"trainer.total_training_steps={steps} ({per_epoch} steps per epoch, total_epochs={epochs})"


def check_data_files(item: str, key: str, cfg: DictConfig) -> str:
    """Every file of ``key`` as the driver checks it before Ray (:func:`gtpo.launch.data_checks.check_data_file`)."""
    from gtpo.launch.data_checks import DataError, check_data_file, prompt_tokenizer

    files = as_list(OmegaConf.select(cfg, key))
    if not files:
        raise PreflightError(item, f"{key} is empty")
    try:
        tokenizer = prompt_tokenizer(cfg)
        rows = sum(check_data_file(path, key, cfg, tokenizer) for path in files)
    except DataError as err:
        raise PreflightError(item, str(err)) from None
    return f"{len(files)} file(s), {rows} rows"


def check_model(cfg: DictConfig) -> str:
    """A local model folder: config.json long enough for prompt + response, tokenizer files, complete weights
    (:func:`weights_problem`). Whether it is the model the preset is sized for is the config check's
    (:func:`gtpo.launch.checks.check_model_folder`)."""
    path = Path(str(cfg.actor_rollout_ref.model.path))
    key = f"actor_rollout_ref.model.path={path}"
    if not path.is_dir():
        raise PreflightError("model", f"{key} is not a local folder (download it once to shared storage)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise PreflightError("model", f"{key}: config.json unreadable ({err})") from None
    need = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int) or positions < need:
        raise PreflightError(
            "model", f"{key}: max_position_embeddings={positions} < max_prompt_length + max_response_length = {need}"
        )
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise PreflightError("model", f"{key}: no tokenizer files")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise PreflightError("model", f"{key}: no weights (*.safetensors / *.bin)")
    problem = weights_problem(path)
    if problem:
        raise PreflightError("model", f"{key}: {problem} (an interrupted download? download it again)")
    return f"{path} (max_position_embeddings={positions} >= {need})"


def weights_problem(folder: Path) -> str | None:
    """What is wrong with the safetensors weights of ``folder``: a shard its index names that is missing, or a file
    shorter than its own header says (each file starts with an 8-byte header length, the JSON header, then the
    tensors at the offsets it lists)."""
    index = folder / "model.safetensors.index.json"
    names = set()
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            return f"{index.name} unreadable ({err})"
        missing = sorted(n for n in names if not (folder / n).is_file())
        if missing:
            return f"{index.name} names {len(names)} shards, {len(missing)} missing ({', '.join(missing[:3])})"
    for shard in sorted(names | {p.name for p in folder.glob("*.safetensors")}):
        file = folder / shard
        size = file.stat().st_size
        try:
            with open(file, "rb") as f:
                length = int.from_bytes(f.read(8), "little") if size >= 8 else -1
                header = json.loads(f.read(length)) if 0 < length <= size - 8 else None
        except (OSError, ValueError) as err:
            return f"{shard}: header unreadable ({err})"
        if not isinstance(header, dict):
            return f"{shard}: {size} bytes, not a safetensors file"
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        if 8 + length + end > size:
            return f"{shard}: {size:,} bytes, its header lists {8 + length + end:,}"
    return None


def check_trackers(cfg: DictConfig, env: dict[str, str]) -> str:
    loggers = as_list(OmegaConf.select(cfg, "trainer.logger"))
    if "wandb" not in loggers:
        return f"trainer.logger={loggers}"
    mode = env.get("WANDB_MODE", "")
    if mode in ("offline", "disabled", "dryrun") or env.get("WANDB_API_KEY"):
        return f"wandb ({'WANDB_MODE=' + mode if mode else 'WANDB_API_KEY set'})"
    raise PreflightError(
        "trackers",
        f"trainer.logger={loggers} but WANDB_API_KEY is unset and WANDB_MODE={mode or '<unset>'}: wandb.init would "
        "fail or hang; set the key where Ray runs, WANDB_MODE=offline, or trainer.logger=[console,file]",
    )


def log_dir_warnings(cfg: DictConfig, env: dict[str, str]) -> list[str]:
    """The ``file`` / ``tensorboard`` loggers of ``trainer.logger`` whose folder is relative (verl's defaults are)."""
    loggers = as_list(OmegaConf.select(cfg, "trainer.logger"))
    runtime_env = OmegaConf.select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars") or {}

    def value(var: str) -> str:
        # The runtime env is what the TaskRunner sees; the recipe's entry point copies this environment's there.
        return str(runtime_env.get(var) or env.get(var) or "")

    wanted = []
    if "file" in loggers:
        var = "VERL_FILE_LOGGER_PATH" if value("VERL_FILE_LOGGER_PATH") else "VERL_FILE_LOGGER_ROOT"
        wanted.append(("file", var, "."))
    if "tensorboard" in loggers:
        wanted.append(("tensorboard", "TENSORBOARD_DIR", "tensorboard_log/<project>/<experiment>"))
    warnings = []
    for logger_name, var, default in wanted:
        if not os.path.isabs(os.path.expanduser(value(var) or default)):
            shown = f"{var}={value(var)}" if value(var) else f"{var} unset (verl's default {default})"
            warnings.append(
                f"trainer.logger has {logger_name} but {shown} is relative: verl's TaskRunner resolves it in its "
                "working directory, a Ray session's scratch folder on whichever node it starts, so the log is lost "
                f"with the session and a resume finds no history; set {var} to shared storage (the launch scripts "
                "put it under CKPTS_DIR)"
            )
    return warnings


def check_checkpoint_dir(path: Path) -> str:
    """Refuse a checkpoint folder others could plant files in: verl loads its shards and ``data.pt`` with
    ``torch.load(weights_only=False)``, which runs code. Returns the ``ok`` detail.

    An existing ``trainer.default_local_dir`` must be a real folder (no symlink) of this user's that neither group
    nor others may write (:func:`gtpo.private_files.check_private_dir`). Of the folders above it, only one everyone
    may write without the sticky bit is refused (:func:`gtpo.private_files.check_unswappable_parents`, as the driver
    and the trainer refuse it before a resume): anyone could rename this one away and put theirs in its place. A
    group-writable project folder is accepted: a folder a group member swapped in would be theirs, which is refused.
    """
    path = Path(os.path.abspath(path))
    try:
        check_unswappable_parents(path, "trainer.default_local_dir")
    except OSError as err:
        raise PreflightError("checkpoint dir", str(err)) from None
    parent = path.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not os.path.lexists(path):
        return f"missing, to be created under {parent}"
    try:
        check_private_dir(path, "trainer.default_local_dir")
    except OSError as err:
        raise PreflightError("checkpoint dir", str(err)) from None
    st = os.lstat(path)
    return f"private (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"
