"""The recipe's trainer behaviour on verl's three v1 trainers, and the startup checks of each mode, without Ray.

    .venv/bin/python -m pytest -q tests/test_async_trainers.py

The advantage step runs on an in-memory stand-in for TransferQueue (``kv_batch_get`` / ``kv_batch_put`` with
verl's jagged per-response fields), so the same batch goes through ``gtpo_sync``, ``gtpo_colocate_async`` and
verl's unmodified ``colocate_async`` trainer.
"""

from __future__ import annotations

import subprocess
import types

import pytest
import torch
from omegaconf import OmegaConf

from gtpo.methods import ENTROPY, METHODS
from tests.support.configs import compose, data_overrides
from tests.support.launch import dry_run_env, resolved_config, script_path
from tests.support.v1_trainers import MemoryTQ, compute_advantages, make_trainer, tq_batch

MODES = {
    "gtpo_sync": ("sync", "verl.trainer.ppo.v1.trainer_sync", "PPOTrainerSync"),
    "gtpo_colocate_async": ("colocate_async", "verl.trainer.ppo.v1.trainer_colocate_async", "PPOTrainerColocateAsync"),
    "gtpo_separate_async": ("separate_async", "verl.trainer.ppo.v1.trainer_separate_async", "PPOTrainerSeparateAsync"),
}
PRESET = {"gtpo_sync": "sync", "gtpo_colocate_async": "colocate_async", "gtpo_separate_async": "separate_async"}
SEPARATE = ["trainer=separate_async", "actor_rollout_ref.rollout.nnodes=1"]


def _base_class(registered: str) -> type:
    import importlib

    _, module, name = MODES[registered]
    return getattr(importlib.import_module(module), name)


def _preset(registered: str) -> list[str]:
    return SEPARATE if registered == "gtpo_separate_async" else [f"trainer={PRESET[registered]}"]


# ---------------------------------------------------------------------------------------------------------------
# the three classes


@pytest.mark.parametrize("registered", list(MODES))
def test_each_mode_resolves_to_its_verl_base_and_reports_its_mode(registered):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    from gtpo.trainer.dynamic_sampling import BoundedDapoReplayBuffer
    from gtpo.trainer.modes import GTPOTrainerMixin

    verl_mode, _, _ = MODES[registered]
    trainer = make_trainer(registered, _preset(registered) + ["method=gtpo"])
    base = _base_class(registered)
    # the recipe's classes (the mixin and the concerns it is composed of), then verl's mode class
    recipe = GTPOTrainerMixin.__mro__[:-1]
    assert type(trainer).__mro__[1 : len(recipe) + 2] == (*recipe, base)
    assert trainer.config.trainer.v1.trainer_mode == registered
    # verl's base class branches on the literal mode: replay buffer class, refill, checkpoints, trainer.v1.<mode>
    assert trainer.trainer_mode == verl_mode
    with pytest.raises(ValueError, match=r"trainer_mode='sync' selects another trainer"):
        trainer.trainer_mode = "sync"
    buffer = trainer._build_replay_buffer()
    if verl_mode == "sync":
        # gtpo's DAPO round limit (10) bounds verl's sync buffer; the async presets set it to 0
        assert type(buffer) is BoundedDapoReplayBuffer and type(buffer).__mro__[1] is ReplayBuffer
        assert buffer.max_num_gen_batches == 10
    else:
        assert type(buffer) is ReplayBufferAsync
    assert buffer.trainer_mode == verl_mode
    assert buffer.trainer_config == trainer.config.trainer.v1.get(verl_mode, {})
    assert buffer.filter_groups_metric == "acc"  # gtpo keeps DAPO's dynamic sampling in every mode


@pytest.mark.parametrize("registered", list(MODES))
def test_mixin_methods_win_and_the_mode_hooks_stay_verl_s(registered):
    from gtpo.trainer.modes import GTPOTrainerMixin

    cls = type(make_trainer(registered, _preset(registered)))
    base = _base_class(registered)
    parts = GTPOTrainerMixin.__mro__[:-1]  # the mixin and its concerns, before object
    recipe = {
        name
        for part in parts
        for name, value in vars(part).items()
        if (callable(value) or isinstance(value, property)) and not name.startswith("__")
    }
    assert {"_compute_advantage", "_log_rollout_data", "_val_metrics_update", "_save_checkpoint"} <= recipe
    for name in recipe:
        assert getattr(cls, name) is getattr(GTPOTrainerMixin, name), name
    # the mode's own hooks (weight sync, abort / resume of partial rollout, old-log-prob versioning) are verl's
    for name in ("on_sample_end", "get_llm_client", "_compute_old_log_prob"):
        assert getattr(cls, name) is getattr(base, name), name
    # the step boundaries go through the preemption check, the first hooks attach the resumed metric history; each then
    # goes on to the mode's own hook
    for name in ("on_step_begin", "on_step_end", "_validate", "on_train_begin", "on_validate_begin"):
        assert getattr(cls, name) is getattr(GTPOTrainerMixin, name), name
        assert getattr(super(parts[-1], cls), name) is getattr(base, name), name


def test_staleness_is_logged_beside_the_estimator_metrics():
    from gtpo.trainer.modes import GTPOTrainerMixin
    from gtpo.trainer.observe.hooks import STALENESS_METRICS

    class VerlStandIn:
        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            metrics.update({key: float(i + 1) for i, key in enumerate(STALENESS_METRICS)})

    class Trainer(GTPOTrainerMixin, VerlStandIn):
        pass

    for estimator, expect in (("gtpo_traj", True), ("grpo", False)):
        trainer = Trainer.__new__(Trainer)  # no verl trainer to construct: only the metric hook runs
        trainer.config = OmegaConf.create({"algorithm": {"adv_estimator": estimator}})
        metrics: dict = {}
        trainer._compute_metrics(None, metrics, {}, global_steps=2, epoch=0)
        mirrored = {k: v for k, v in metrics.items() if k.startswith(f"{estimator}/")}
        want = {f"{estimator}/{name}": float(i + 1) for i, name in enumerate(STALENESS_METRICS.values())}
        assert mirrored == (want if expect else {})


# ---------------------------------------------------------------------------------------------------------------
# the advantage step on one batch, through an in-memory TransferQueue


@pytest.mark.parametrize("method", ["gtpo", "gtpo_traj"])
def test_colocate_async_advantages_equal_sync_on_the_same_batch(method, monkeypatch):
    rows, meta = tq_batch()
    common = [f"method={method}", "algorithm.gtpo.conflict_mask=true", "algorithm.gtpo_traj.h_ini=1.0"]
    sync_adv, sync_metrics = compute_advantages(make_trainer("gtpo_sync", common), monkeypatch, rows, meta)
    async_trainer = make_trainer("gtpo_colocate_async", ["trainer=colocate_async", *common])
    async_adv, async_metrics = compute_advantages(async_trainer, monkeypatch, rows, meta)
    assert any(torch.count_nonzero(a) for a in sync_adv), "a batch with all-zero advantages would prove nothing"
    for a, b in zip(sync_adv, async_adv, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the kernel's compile time is reported by the first call in the process only
    same = lambda metrics: {k: v for k, v in metrics.items() if not k.endswith("/kernel_compile_s")}  # noqa: E731
    assert same(sync_metrics) == same(async_metrics) and any(k.startswith(f"{method}/") for k in async_metrics)
    # the entropy reached the estimator: other entropies give other advantages
    shifted = {k: dict(v, entropy=v["entropy"] * 2.0) for k, v in rows.items()}
    other, _ = compute_advantages(async_trainer, monkeypatch, shifted, meta)
    assert any(not torch.equal(a, b) for a, b in zip(other, async_adv, strict=True))


def test_verl_unmodified_async_trainer_drops_the_entropy(monkeypatch):
    """Negative control: verl's own colocate_async advantage step never hands the estimator the entropy."""
    import verl.trainer.ppo.core_algos as core_algos
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync

    import gtpo.verl_plugin.register  # noqa: F401

    seen: list[dict] = []
    real = core_algos.get_adv_estimator_fn("gtpo")

    def spy(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "gtpo", spy)
    trainer = PPOTrainerColocateAsync.__new__(PPOTrainerColocateAsync)
    trainer.config = compose(["method=gtpo", "trainer.v1.trainer_mode=colocate_async"])
    OmegaConf.resolve(trainer.config)
    trainer.trainer_mode = "colocate_async"
    rows, meta = tq_batch()  # the entropy *is* in TransferQueue
    with pytest.raises(ValueError, match=r"entropy=None"):
        compute_advantages(trainer, monkeypatch, rows, meta)
    assert len(seen) == 1 and "entropy" not in seen[0] and "responses" not in seen[0]

    seen.clear()
    recipe = make_trainer("gtpo_colocate_async", ["trainer=colocate_async", "method=gtpo"])
    compute_advantages(recipe, monkeypatch, rows, meta)
    # what gtpo's row needs, and only that: the token ids only under conflict_mask
    assert len(seen) == 1 and seen[0]["entropy"] is not None and seen[0]["responses"] is None
    seen.clear()
    recipe = make_trainer(
        "gtpo_colocate_async", ["trainer=colocate_async", "method=gtpo", "algorithm.gtpo.conflict_mask=true"]
    )
    compute_advantages(recipe, monkeypatch, rows, meta)
    assert len(seen) == 1 and seen[0]["entropy"] is not None and seen[0]["responses"] is not None


def _groups_batch(groups: str):
    """Four responses per prompt group, one group per letter of ``groups``, in TQ form; returns (rows, meta)."""
    from transfer_queue import KVBatchMeta

    gen = torch.Generator().manual_seed(11)
    rows = {}
    for g, uid in enumerate(groups):
        for j, r in enumerate([1.0, -1.0, 1.0, -1.0] if g % 2 == 0 else [1.0, -1.0, -1.0, -1.0]):
            n = 2 + (g + j) % 4
            scores = torch.zeros(n)
            scores[-1] = r
            rows[f"{uid}{j}"] = {
                "uid": uid,
                "response_mask": torch.ones(n, dtype=torch.int64),
                "rm_scores": scores,
                "old_log_probs": -torch.rand(n, generator=gen),
                "responses": torch.randint(0, 5, (n,), generator=gen),
                "entropy": torch.rand(n, generator=gen) * 3 + 0.1,
            }
    return rows, KVBatchMeta(partition_id="train", keys=list(rows), tags=[{}] * len(rows))


@pytest.mark.parametrize("registered,sync_step", [("gtpo_separate_async", 2), ("gtpo_sync", 1)])
def test_each_estimator_call_logs_the_rows_and_groups_it_saw(registered, sync_step, monkeypatch):
    """verl's own PPOTrainer.step on 4 prompt groups of 4: under separate_async with parameter_sync_step=2 it calls
    the advantage step on two slices of 2 groups (8 rows) each; verl's metrics aggregator then reports the rows and
    groups per call (its mean) and the calls (a "_total": summed). The sync trainer's one call sees all 16 rows."""
    import transfer_queue
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode, PPOTrainerSeparateAsync

    sizes = [
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=4",
    ]
    overrides = ["method=gtpo", *sizes]
    if registered == "gtpo_separate_async":
        overrides = [*SEPARATE, *overrides, f"trainer.v1.separate_async.parameter_sync_step={sync_step}"]
    trainer = make_trainer(registered, overrides)
    rows, meta = _groups_batch("abcd")
    store = MemoryTQ(rows)
    monkeypatch.setattr(transfer_queue, "kv_batch_get", store.kv_batch_get)
    monkeypatch.setattr(transfer_queue, "kv_batch_put", store.kv_batch_put)

    class Buffer:  # verl's replay buffer hands out the groups in order, batch_size prompts at a time
        def __init__(self):
            self.taken = 0

        def sample(self, global_steps, partition_id, batch_size):
            keys = meta.keys[self.taken * 4 : (self.taken + batch_size) * 4]
            self.taken += batch_size
            return KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys)), {}

    trainer.replay_buffer = Buffer()
    trainer.parameter_sync_step = sync_step  # verl's PPOTrainer.__init__ reads it from trainer.v1.<mode>
    trainer.reward_loop_manager = types.SimpleNamespace(reward_loop_worker_handles=["standalone reward workers"])
    trainer.use_reference_policy = trainer.use_critic = False
    trainer.current_mode = HybridEngineMode.TRAINER
    trainer.hybrid_rollout_config = types.SimpleNamespace(enable_switch=False)
    trainer._step_sample_wait_seconds = 0.0
    trainer.checkpoint_manager = types.SimpleNamespace(sleep_replicas=lambda: None)  # the sync trainer's vLLM sleep
    trainer.curr_step_profile = False
    # the worker-side passes are not what this test is about
    monkeypatch.setattr(PPOTrainer, "_add_batch_to_generate", lambda self: None)
    monkeypatch.setattr(PPOTrainer, "_balance_batch", lambda self, batch, metrics: batch)
    monkeypatch.setattr(PPOTrainer, "_update_actor", lambda self, batch, metrics: batch)
    for cls in (PPOTrainer, PPOTrainerSeparateAsync):
        monkeypatch.setattr(cls, "_compute_old_log_prob", lambda self, batch, metrics: batch)

    metrics: dict = {}
    batch = trainer.step(metrics, {})
    assert len(batch.keys) == 16 and trainer.replay_buffer.taken == 4
    calls = sync_step
    assert metrics["gtpo/estimator_rows"] == 16 / calls and metrics["gtpo/estimator_groups"] == 4 / calls
    assert metrics["gtpo/estimator_calls_total"] == calls
    assert all(torch.count_nonzero(store.rows[k]["advantages"]) for k in ("a0", "d0"))  # every slice got advantages


def test_batch_scopes_under_parameter_sync_step_are_a_startup_note():
    from gtpo.launch.batch_checks import startup_notes

    def notes(*overrides):
        return startup_notes(compose([*SEPARATE, "model=qwen2.5_7b", *overrides]))

    (note,) = notes("method=gtpo")
    assert note.startswith("algorithm.gtpo.norm_scope=batch, algorithm.gtpo.weight_scope=batch with ")
    assert "parameter_sync_step=4" in note and "32 prompts (512 responses), not the step's 128 (2048)" in note
    assert "gtpo/estimator_rows" in note
    (note,) = notes("method=gtpo", "algorithm.gtpo.norm_scope=group")
    assert note.startswith("algorithm.gtpo.weight_scope=batch with")
    assert notes("method=gtpo", "algorithm.gtpo.norm_scope=group", "algorithm.gtpo.weight_scope=group") == []
    (note,) = notes("method=dapo_forking")  # the preset's whole-batch quantile
    assert note.startswith("algorithm.forking.scope=batch with") and "forking/batch_scope_rows" in note
    # micro-batch quantile: per micro-batch in every mode
    assert notes("method=dapo_forking", "algorithm.forking.scope=micro_batch") == []
    assert notes("method=grpo_s") == []
    one_update = ["trainer.v1.separate_async.parameter_sync_step=1", "actor_rollout_ref.actor.ppo_mini_batch_size=128"]
    assert notes("method=gtpo", *one_update) == []
    assert startup_notes(compose(["method=gtpo"])) == [] and startup_notes(compose(["trainer=colocate_async"])) == []


# ---------------------------------------------------------------------------------------------------------------
# startup errors (validate_recipe_config: the entry point runs it before Ray, the dry run too)


def _validate(overrides: list[str]) -> None:
    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import validate_recipe_config

    validate_recipe_config(compose(overrides))


@pytest.mark.parametrize("preset", ["sync", "colocate_async", "separate_async"])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_composes_under_every_mode(preset, method):
    overrides = [f"trainer={preset}", f"method={method}", "model=qwen2.5_7b"]
    if preset == "separate_async":
        overrides += ["actor_rollout_ref.rollout.nnodes=1"]
        if method == "gtpo_traj":  # one mini-batch per step: weights synced after it
            overrides += ["trainer.v1.separate_async.parameter_sync_step=1"]
    _validate(overrides)
    cfg = compose(overrides)
    assert cfg.trainer.v1.trainer_mode == f"gtpo_{preset}"
    if preset != "sync":
        assert cfg.algorithm.filter_groups.max_num_gen_batches == 0


# The rows that need the old policy's entropy (gtpo.methods.fields_needed), which bypass mode never computes.
@pytest.mark.parametrize("estimator", sorted({r.adv_estimator for r in METHODS.values() if ENTROPY in r.needs}))
@pytest.mark.parametrize("preset", ["sync", "colocate_async"])
def test_bypass_mode_is_refused_for_the_recipe_estimators(estimator, preset):
    with pytest.raises(ValueError, match=rf"bypass_mode=true with algorithm.adv_estimator='{estimator}'"):
        _validate(
            [
                f"trainer={preset}",
                f"algorithm.adv_estimator={estimator}",
                "algorithm.rollout_correction.bypass_mode=true",
            ]
        )


def test_bypass_mode_and_the_forking_loss():
    bypass = ["trainer=colocate_async", "method=dapo_forking", "algorithm.rollout_correction.bypass_mode=true"]
    with pytest.raises(ValueError, match=r"bypass_mode=true with algorithm.forking.scope=batch"):
        _validate([*bypass, "algorithm.forking.scope=batch"])
    # micro_batch: the training policy's entropy, computed in the update itself
    _validate([*bypass, "algorithm.forking.scope=micro_batch", "actor_rollout_ref.actor.calculate_entropy=true"])
    with pytest.raises(ValueError, match=r"forking.scope=batch"):
        _validate(bypass)  # the preset selects over the whole batch
    _validate(["trainer=colocate_async", "method=grpo", "algorithm.rollout_correction.bypass_mode=true"])


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_verl_s_own_trainers_are_refused_for_the_recipe(mode):
    with pytest.raises(ValueError, match=rf"trainer.v1.trainer_mode='{mode}'.*gtpo_colocate_async"):
        _validate(["method=gtpo", f"trainer.v1.trainer_mode={mode}"])
    with pytest.raises(ValueError, match=rf"trainer.v1.trainer_mode='{mode}': algorithm.forking.enable=true needs one"):
        _validate(["method=dapo_forking", f"trainer.v1.trainer_mode={mode}"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["actor_rollout_ref.actor.ppo_mini_batch_size=16"],
            r"data.train_batch_size=128 != trainer.v1.separate_async.parameter_sync_step=4 x "
            r"actor_rollout_ref.actor.ppo_mini_batch_size=16.*parameter_sync_step=8",
        ),
        (["actor_rollout_ref.rollout.nnodes=0"], r"actor_rollout_ref.rollout.nnodes=0: separate_async needs"),
        (["actor_rollout_ref.rollout.n_gpus_per_node=0"], r"actor_rollout_ref.rollout.n_gpus_per_node=0"),
        (["actor_rollout_ref.rollout.checkpoint_engine.backend=naive"], r"checkpoint_engine.backend=naive"),
        (
            ["reward.reward_model.enable=true", "reward.reward_model.enable_resource_pool=false"],
            r"reward.reward_model.enable_resource_pool=false",
        ),
        (["algorithm.filter_groups.max_num_gen_batches=10"], r"algorithm.filter_groups.max_num_gen_batches=10"),
        (["trainer.v1.separate_async.parameter_sync_step=3"], r"not divisible by .*parameter_sync_step=3"),
    ],
)
def test_each_violated_separate_async_constraint_names_its_key(overrides, message):
    base = [*SEPARATE, "method=gtpo", "model=qwen2.5_7b"]
    _validate(base)
    with pytest.raises(ValueError, match=message):
        _validate(base + overrides)


@pytest.mark.parametrize("preset", ["sync", "colocate_async"])
def test_a_rollout_pool_outside_separate_async_is_refused(preset):
    with pytest.raises(
        ValueError, match=rf"actor_rollout_ref.rollout.nnodes=2 with trainer.v1.trainer_mode=gtpo_{preset}"
    ):
        _validate([f"trainer={preset}", "actor_rollout_ref.rollout.nnodes=2"])


def test_separate_async_preset_gives_the_rollout_gpus_to_vllm():
    """verl's v1 trainers read gpu_memory_utilization for every replica (standalone_gpu_memory_utilization only in
    its experimental fully-async trainer): with no replicas on the training GPUs, the preset's value is the pool's."""
    cfg = compose([*SEPARATE, "method=gtpo", "model=qwen2.5_7b"])
    assert cfg.actor_rollout_ref.hybrid_engine is False
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.85
    assert compose(["method=gtpo", "model=qwen2.5_7b"]).actor_rollout_ref.rollout.gpu_memory_utilization == 0.6


@pytest.mark.parametrize("cupy", [None, "stand-in"])
def test_the_entry_point_refuses_nccl_without_cupy(cupy, monkeypatch, tmp_path):
    """prepare_config, before Ray: cupy's import failure simulated (sys.modules["cupy"] = None makes it raise)."""
    import sys

    import gtpo.verl_plugin.register  # noqa: F401
    from recipe.gtpo.main_gtpo import prepare_config

    monkeypatch.setitem(sys.modules, "cupy", None if cupy is None else types.ModuleType("cupy"))
    cfg = compose([*SEPARATE, "method=gtpo", "model=qwen2.5_7b"])
    if cupy is None:
        with pytest.raises(ValueError, match=r"backend=nccl: verl's nccl checkpoint engine imports cupy") as err:
            prepare_config(cfg)
        assert "install cupy-cuda13x==14.0.1" in str(err.value)
        prepare_config(compose([*SEPARATE, "method=gtpo", "model=qwen2.5_7b"]), dry_run=True)  # a laptop dry run
    else:
        prepare_config(compose([*SEPARATE, "method=gtpo", "model=qwen2.5_7b", *data_overrides(tmp_path)]))
    # the naive engine of the other modes imports nothing
    prepare_config(compose(["method=gtpo", "model=qwen2.5_7b", *data_overrides(tmp_path)]))


def test_colocate_async_constraints():
    _validate(["trainer=colocate_async", "method=dapo"])
    with pytest.raises(ValueError, match=r"hybrid_engine=false with trainer.v1.trainer_mode=gtpo_colocate_async"):
        _validate(["trainer=colocate_async", "actor_rollout_ref.hybrid_engine=false"])
    with pytest.raises(ValueError, match=r"max_num_gen_batches=10 with trainer.v1.trainer_mode=gtpo_colocate_async"):
        _validate(["trainer=colocate_async", "method=dapo", "algorithm.filter_groups.max_num_gen_batches=10"])
    # the sync trainer keeps DAPO's round limit
    _validate(["trainer=sync", "method=dapo"])
    assert compose(["method=dapo"]).algorithm.filter_groups.max_num_gen_batches == 10


def test_the_dry_run_module_checks_the_mode_too(monkeypatch, capsys):
    import verl  # noqa: F401

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.dry_run import main

    monkeypatch.chdir(script_path("gtpo", "7b").parents[1])
    argv = [*SEPARATE, "method=gtpo", "model=qwen2.5_7b", "actor_rollout_ref.rollout.checkpoint_engine.backend=naive"]
    assert main(argv) == 2
    assert "checkpoint_engine.backend=naive" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# the launchers take the mode as an argument


@pytest.mark.parametrize(
    "size, args, mode",
    [
        ("7b", ["trainer=colocate_async"], "gtpo_colocate_async"),
        ("32b", [*SEPARATE], "gtpo_separate_async"),
    ],
)
def test_launchers_accept_the_mode(tmp_path, size, args, mode):
    script = str(script_path("gtpo", size))
    proc = subprocess.run(
        ["bash", script, *args], cwd=tmp_path, env=dry_run_env(tmp_path), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    cfg = resolved_config(proc.stdout)
    assert cfg["trainer"]["v1"]["trainer_mode"] == mode
    assert f"trainer_mode={mode}" in proc.stdout
    if mode == "gtpo_separate_async":
        assert cfg["actor_rollout_ref"]["rollout"]["checkpoint_engine"]["backend"] == "nccl"
        bad = subprocess.run(
            ["bash", script, "trainer=separate_async"],
            cwd=tmp_path, env=dry_run_env(tmp_path), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert bad.returncode != 0 and "actor_rollout_ref.rollout.nnodes=0" in bad.stderr


def test_separate_async_setup_survives_verl_logging_with_flush(monkeypatch, caplog):
    """verl 0.9.1's ``_setup`` logs the hybrid_engine=false case with ``logger.info(..., flush=True)``, which the
    standard library's Logger refuses: the recipe's separate_async trainer runs it with a logger that drops it."""
    import logging

    from verl.trainer.ppo.v1 import trainer_separate_async
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from gtpo.trainer.modes import GTPOTrainerSeparateAsync

    def verl_setup(self):  # what verl's _setup does on the hybrid_engine=false branch
        trainer_separate_async.logger.info("[V1SepAsync] hybrid replicas disabled", flush=True)

    monkeypatch.setattr(PPOTrainer, "_setup", lambda self: None)
    monkeypatch.setattr(trainer_separate_async.PPOTrainerSeparateAsync, "_setup", verl_setup)
    trainer = GTPOTrainerSeparateAsync.__new__(GTPOTrainerSeparateAsync)
    with caplog.at_level(logging.INFO, logger=trainer_separate_async.logger.name):
        trainer._setup()
    assert "hybrid replicas disabled" in caplog.text
    # the logger is verl's own again afterwards, and verl's call on its own fails as in verl 0.9.1
    assert type(trainer_separate_async.logger) is logging.Logger and "_log" not in vars(trainer_separate_async.logger)
    with pytest.raises(TypeError, match="flush"):
        verl_setup(trainer)
