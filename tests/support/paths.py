"""One PPO step's old-log-prob pass and actor update through verl 0.9.1's own worker code on each path the presets
take, without Ray. Used by ``tests/test_path_equivalence.py``.

A path is a set of config overrides on top of the CPU backend (:data:`PATHS`): padded with fixed micro-batches (the
reference), remove padding, token-budget micro-batches (verl reorders rows by length, packs them, restores the order),
chunked entropy, activation checkpointing (the model presets' path), Ulysses sequence parallelism 2 at world size 2,
data parallelism 2 at world size 2, and parameter / optimizer offload (the 32B preset).

In every rank process (spawned, gloo, as in ``tests/support/dp.py``), for one path:

1. the driver steps of verl's ``PPOTrainer._step_once`` run on the recipe's trainer class, identically on every rank:
   ``_balance_batch`` for the path's data-parallel size, then ``_compute_old_log_prob``, whose worker call is answered
   by :class:`RankWorkerGroup`: this rank's chunk of verl's dispatch goes, as ``tqbridge`` hands it over, to the real
   ``ActorRolloutRefWorker.compute_log_prob`` of a worker built on the *old* policy (verl's FSDP2 engine: packing,
   micro-batches, chunked entropy, the Ulysses gather), and every rank gets every chunk's output back (all-gather), as
   TransferQueue would store it;
2. for each method, the recipe's ``_compute_advantage`` (the estimator on the whole batch) and ``_update_actor``, then
   verl's ``update_actor`` on a worker built on the *trained* policy (the old one plus noise), recording every
   micro-batch's loss inputs, the reduced metrics and the updated weights.

A planted fault (:data:`FAULTS`) replaces one verl function in the rank process for the old-log-prob pass only, to
show that the comparison catches what such a path can break silently.
"""

from __future__ import annotations

import copy
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.support import dp as S

# Token budgets of the dynamic paths: verl's synthetic padding row has 128 tokens (SYNTHETIC_PADDING_SEQ_LEN in
# verl/trainer/ppo/padding_utils.py) and must fit; the 15 real rows of 10-27 tokens (282 in all) then fill 3-4
# micro-batches of different composition in both passes.
TRAIN_TOKENS = 128
LOG_PROB_TOKENS = 128
# Chunked entropy in 7-token chunks: boundaries fall inside sequences and between them.
ENTROPY_CHUNK = 7

_REMOVE_PADDING = ("actor_rollout_ref.model.use_remove_padding=true",)
_DYNAMIC = (
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TRAIN_TOKENS}",
    f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={LOG_PROB_TOKENS}",
)
_CHUNKED = (
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
    f"actor_rollout_ref.actor.entropy_from_logits_chunk_size={ENTROPY_CHUNK}",
)
_CHECKPOINTING = ("actor_rollout_ref.model.enable_gradient_checkpointing=true",)
PRESET = (*S.PADDED, *_REMOVE_PADDING, *_DYNAMIC, *_CHUNKED, *_CHECKPOINTING)


@dataclass(frozen=True)
class ComputePath:
    """A way through verl's worker code: ``world_size`` ranks, Ulysses size ``sp``, config ``overrides``."""

    overrides: tuple[str, ...]
    world_size: int = 1
    sp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // self.sp


# name -> path; each adds one thing to the one before it (the model presets compute on "checkpointing")
PATHS = {
    "padded": ComputePath(S.PADDED),
    "remove_padding": ComputePath((*S.PADDED, *_REMOVE_PADDING)),
    "dynamic_bsz": ComputePath((*S.PADDED, *_REMOVE_PADDING, *_DYNAMIC)),
    "chunked_entropy": ComputePath((*S.PADDED, *_REMOVE_PADDING, *_DYNAMIC, *_CHUNKED)),
    "checkpointing": ComputePath(PRESET),
    "offload": ComputePath(
        (
            *PRESET,
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        )
    ),
    "ulysses2": ComputePath((*PRESET, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"), world_size=2, sp=2),
    "dp2": ComputePath(PRESET, world_size=2),
}

# Methods trained on every path ("forking_micro_batch" too: it differs by design where micro-batches differ).
METHODS = tuple(S.METHODS)

# The random tiny model's next-token entropies all lie within 0.05 nats of ln(43); its final norm scaled by this makes
# them spread over 0.1-3.7 nats, as a trained model's do, so that a wrong token's entropy is far off.
SHARPEN = 8.0


def build_models() -> tuple:
    """``dp.build_models`` with the final norm of both models scaled by :data:`SHARPEN`."""
    old, trained = S.build_models()
    with torch.no_grad():
        for model in (old, trained):
            model.model.norm.weight.mul_(SHARPEN)
    return old, trained


# planted fault -> the path whose old-log-prob pass it breaks
FAULTS = {
    "entropy_rows_swapped_after_reorder": "dynamic_bsz",
    "chunk_boundary_off_by_one": "chunked_entropy",
    "sp_shards_gathered_in_wrong_order": "ulysses2",
}


# ----------------------------------------------------------------------------------------------------------------
# planted faults


def _swap_equal_length_rows(nested: torch.Tensor) -> torch.Tensor:
    """The first two rows of equal length and different values exchanged (lengths stay valid: silent)."""
    rows = list(nested.unbind())
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            if len(rows[i]) == len(rows[j]) and not torch.equal(rows[i], rows[j]):
                rows[i], rows[j] = rows[j], rows[i]
                return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    raise AssertionError("no two rows of equal length to swap")


def _chunked_entropy_off_by_one(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """verl's chunked entropy with each chunk's last position left out (it stays 0)."""
    from verl.utils.torch_functional import entropy_from_logits

    entropy = torch.zeros(logits.shape[0], device=logits.device)
    for i in range(0, logits.shape[0], chunk_size):
        end = min(i + chunk_size, logits.shape[0]) - 1
        entropy[i:end] = entropy_from_logits(logits[i:end].float())
    return entropy


def _gather_reversed(x, gather_dim, unpad_dim=None, padding_size=0, grad_scaler=True, group=None):
    """The Ulysses gather with the shards concatenated in reverse rank order (forward only)."""
    import torch.distributed as dist
    from verl.utils.ulysses import get_ulysses_sequence_parallel_group

    group = get_ulysses_sequence_parallel_group() if group is None else group
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    x = torch.cat(parts[::-1], dim=gather_dim)
    if unpad_dim is not None and padding_size:
        x = x.narrow(unpad_dim, 0, x.size(unpad_dim) - padding_size)
    return x


@contextmanager
def planted(fault: str | None):
    """Replace one verl function for the duration (before the worker is built: the engine binds its entropy
    function at construction)."""
    if fault is None:
        yield
        return
    import verl.utils.torch_functional as verl_F
    import verl.workers.engine.fsdp.transformer_impl as impl

    if fault == "entropy_rows_swapped_after_reorder":
        module, name = impl, "postprocess_batch_func"
        original = impl.postprocess_batch_func

        def replacement(output_lst, indices, data):
            out = original(output_lst, indices, data)
            if "entropy" in out["model_output"]:
                out["model_output"]["entropy"] = _swap_equal_length_rows(out["model_output"]["entropy"])
            return out
    elif fault == "chunk_boundary_off_by_one":
        module, name, replacement = verl_F, "entropy_from_logits_with_chunking", _chunked_entropy_off_by_one
    elif fault == "sp_shards_gathered_in_wrong_order":
        module, name, replacement = impl, "gather_outputs_and_unpad", _gather_reversed
    else:
        raise ValueError(f"fault={fault!r}: one of {sorted(FAULTS)}")
    saved = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, saved)


# ----------------------------------------------------------------------------------------------------------------
# rank side


class RankWorkerGroup(S.DriverWorkerGroup):
    """The actor worker group as the driver sees it, inside one rank: ``compute_log_prob`` runs verl's worker on this
    rank's chunk and all-gathers every chunk's output into the store; ``update_actor`` captures the dispatch."""

    def __init__(self, path: ComputePath, rank: int, store: S.MemoryTQ, worker):
        super().__init__(path.dp, store, old_model=None)
        self.path, self.rank, self.worker = path, rank, worker

    def compute_log_prob(self, batch):
        import torch.distributed as dist

        chunk = batch.chunk(self.path.dp)[self.rank // self.path.sp]
        rows = self.store.get_rows(chunk.keys)
        out = self.worker.compute_log_prob(S.worker_input(rows, self.store.nested_fields(), batch.extra_info))
        mine = None
        if out is not None:  # the sp group's first rank holds the output, as verl collects it
            mine = {
                key: (lp.clone(), ent.clone())
                for key, lp, ent in zip(chunk.keys, out["log_probs"].unbind(), out["entropy"].unbind(), strict=True)
            }
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        for part in gathered:
            for key, (lp, ent) in (part or {}).items():
                self.store.rows[key]["log_probs"], self.store.rows[key]["entropy"] = lp, ent
        return batch


@dataclass
class PathResult:
    """What rank 0 reports for one path (or one planted fault: ``old`` only)."""

    old: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # key -> response log-probs, H
    advantages: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # method -> key -> advantages
    batches: dict[str, S.DriverBatch] = field(default_factory=dict)  # method -> what the update was given
    updates: dict[str, S.RankResult] = field(default_factory=dict)  # method -> rank 0's update
    seconds: float = 0.0


def _build_worker(cfg, model_dir: Path):
    from verl.workers.engine_workers import ActorRolloutRefWorker

    cfg = copy.deepcopy(cfg)
    cfg.actor_rollout_ref.model.path = str(model_dir)
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def _old_pass(path: ComputePath, rank: int, folder: Path, fault: str | None):
    """Balance and old-log-prob pass of the rollout batch; returns the store, the balanced batch and its driver."""
    from transfer_queue import KVBatchMeta

    keys, rows, tags = S.rollout_rows(S.build_tokenizer())
    store = S.MemoryTQ()
    store.rows = {k: dict(r) for k, r in zip(keys, rows, strict=True)}
    store.tags = {k: dict(t) for k, t in zip(keys, tags, strict=True)}
    batch = KVBatchMeta(keys=keys, tags=tags, partition_id="train", extra_info={"temperature": 1.0})
    cfg = S.compose_config("gtpo", folder / "model", path.overrides)
    drv = S.make_driver(cfg, path.dp, store, old_model=None)
    with planted(fault):
        worker = _build_worker(cfg, folder / "old_model")
        drv.actor_rollout_wg = RankWorkerGroup(path, rank, store, worker)
        with S.patched_tq(store):
            batch = drv._balance_batch(batch, metrics={})
            # verl names its padding rows with a random uuid: every rank takes rank 0's batch, as verl's one driver
            shared = [batch, store.rows, store.tags]
            torch.distributed.broadcast_object_list(shared, src=0)
            batch, store.rows, store.tags = shared
            batch = drv._compute_old_log_prob(batch, metrics={})
    del worker
    return store, batch


def _train(path: ComputePath, rank: int, folder: Path, method: str, store: S.MemoryTQ, batch) -> tuple:
    cfg = S.compose_config(method, folder / "model", path.overrides)
    store = copy.deepcopy(store)
    drv = S.make_driver(cfg, path.dp, store, old_model=None)
    group = RankWorkerGroup(path, rank, store, worker=None)
    drv.actor_rollout_wg = group
    metrics: dict = {}
    with S.patched_tq(store):
        advantaged = drv._compute_advantage(copy.deepcopy(batch), metrics=metrics)
        drv._update_actor(advantaged, metrics=metrics)
    sent = group.sent
    driver_batch = S.DriverBatch.dispatched(sent, store, metrics, path.dp)
    rows = [driver_batch.rows[k] for k in sent.chunk(path.dp)[rank // path.sp].keys]
    worker = _build_worker(cfg, folder / "model")
    data = S.worker_input(rows, driver_batch.nested, driver_batch.extra_info)
    result = S.train_and_record(cfg, worker, data, rank)
    return driver_batch, result


def run_path(name: str, rank: int, folder: Path, fault: str | None = None) -> PathResult:
    """One path's old-log-prob pass and, without a fault, every method's update (see the module docstring)."""
    started = time.perf_counter()
    path = PATHS[name]
    store, batch = _old_pass(path, rank, folder, fault)
    result = PathResult()
    for key in batch.keys:  # what the driver stored: response tokens only, as the estimators read them
        row = store.rows[key]
        assert len(row["old_log_probs"]) == len(row["entropy"]) == len(row["responses"]), key
        result.old[key] = (row["old_log_probs"].clone(), row["entropy"].clone())
    if fault is None:
        for method in METHODS:
            driver_batch, update = _train(path, rank, folder, method, store, batch)
            result.batches[method] = driver_batch
            result.advantages[method] = {k: driver_batch.rows[k]["advantages"].clone() for k in driver_batch.keys}
            result.updates[method] = update
    result.seconds = time.perf_counter() - started
    return result


def _rank_main(rank: int, world_size: int, port: int, jobs: list[tuple[str, str | None]], folder: str) -> None:
    S.rank_environment(rank, world_size, port)
    out = Path(folder) / f"ws{world_size}"
    try:
        import verl  # noqa: F401  (loads the cpu platform and the recipe's registrations)

        results = {(name, fault): run_path(name, rank, Path(folder), fault) for name, fault in jobs}
        if rank == 0:
            torch.save(results, out / "rank0.pt")
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def start(world_size: int, jobs: list[tuple[str, str | None]], folder: Path):
    """Spawn ``world_size`` rank processes running ``jobs`` (``(path, fault)`` pairs, all of that world size);
    ``folder`` holds ``model`` (trained) and ``old_model``."""
    import multiprocessing

    assert all(PATHS[name].world_size == world_size for name, _ in jobs)
    (folder / f"ws{world_size}").mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    port = S._free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, jobs, str(folder)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


def wait(groups: dict[int, list], folder: Path, timeout: float) -> dict[tuple[str, str | None], PathResult]:
    """Wait for every group (``dp.wait_processes``); every job's rank-0 result by ``(path, fault)``."""
    S.wait_processes(groups, lambda ws: folder / f"ws{ws}", timeout)
    results = {}
    for ws in groups:
        results.update(torch.load(folder / f"ws{ws}" / "rank0.pt", weights_only=False))
    return results


def run_all(folder: Path, timeout: float = 900) -> dict[tuple[str, str | None], PathResult]:
    """Every path and every planted fault; world sizes 1 and 2 run side by side."""
    old, trained = build_models()
    S.write_model_dir(folder / "model", trained)
    S.write_model_dir(folder / "old_model", old)
    jobs: dict[int, list] = {1: [], 2: []}
    for name, path in PATHS.items():
        jobs[path.world_size].append((name, None))
    for fault, name in FAULTS.items():
        jobs[PATHS[name].world_size].append((name, fault))
    groups = {ws: start(ws, js, folder) for ws, js in jobs.items()}
    return wait(groups, folder, timeout)
