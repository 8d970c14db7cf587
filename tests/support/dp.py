"""One PPO actor update through verl 0.9.1's real driver and worker code, at data-parallel size 1 or 2, without Ray.

Used by ``tests/test_dp_equivalence.py``.

Driver side (the test process): a fixed rollout batch of 4 prompt groups (one group a response short, as after a
failed rollout session) is put into :class:`MemoryTQ`, a dict standing in for TransferQueue's ``kv_batch_get`` /
``kv_batch_put``. Then the recipe's trainer class (``GTPOTrainerSync``, built without its constructor) runs the
steps of verl's ``PPOTrainer._step_once`` that shape the actor's input: ``_balance_batch`` (verl's synthetic
``is_padding`` rows and its sequence-length balanced row order for the given dp size), ``_compute_old_log_prob``
(the worker call answered by :class:`DriverWorkerGroup` with an HF forward of the *old* policy), the recipe's
``_compute_advantage`` (estimator on the whole batch, padding rows excluded) or verl's for ``grpo``, and the
recipe's ``_update_actor`` (forking ``scope=batch`` threshold into ``extra_info``) followed by verl's, whose
dispatch the stub captures. ``KVBatchMeta.chunk(dp)`` then gives each rank its rows, as verl's dispatch does.

Worker side (:func:`start_ranks` / :func:`wait_ranks`, spawned processes over gloo): each rank builds verl's
``ActorRolloutRefWorker`` (a plain class under Ray's decorator) from the composed recipe config, ``init_model()``
(verl's FSDP2 engine, the ``ppo_loss`` it binds, the recipe's loss replacement from ``actor_loss.install``), reads its
rows exactly as verl's ``tqbridge`` would hand them over (jagged tensors, ``extra_info`` as non-tensor data) and
calls ``update_actor``: verl's ``train_mini_batch`` -> ``train_batch`` -> ``FSDPEngine.train_batch`` (global
``batch_num_tokens`` all-reduced over dp, micro-batches, backward, FSDP2 gradient reduce-scatter, clip, optimizer).

The policy being trained differs from the old policy (its weights are the old ones plus noise, as at a later
mini-batch), so the probability ratios leave the clip range on over a quarter of the tokens and on some GRPO-S
sequences. The optimizer is SGD without weight decay and with a gradient-clipping bound far above the gradient norm:
the weight change is then ``lr`` times the gradient itself (AdamW's first step is about ``lr * sign(g)``, and
clipping to norm 1 rescales a gradient of norm 1.7 and one of norm 3.4 to the same step: either would hide a wrong
gradient scale).
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import os
import socket
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from gtpo.methods import METHODS as ROWS

# (prompt length, response lengths, rewards) per prompt group; the second group lost one of its 4 sessions.
GROUPS = (
    (7, (5, 16, 9, 3), (1.0, 0.0, 0.0, 1.0)),
    (11, (12, 4, 16), (0.0, 1.0, 1.0)),
    (5, (8, 14, 6, 10), (1.0, 1.0, 1.0, 0.0)),
    (9, (16, 7, 11, 2), (0.0, 0.0, 1.0, 0.0)),
)
ROLLOUT_N = 4
MAX_RESPONSE = 16
MICRO_BATCH = 4
LR = 0.05
CLIP_GRAD = 1.0e4  # no clipping in effect: the update keeps the gradient's scale
PERTURB = 0.05  # std of the noise that separates the trained policy's weights from the old policy's
RHO = 0.2

# name -> recipe config overrides (on top of backend=cpu_tiny and the batch settings of compose_config): every recipe
# estimator of the method table, and the forking-token loss at both scopes
METHODS = {
    **{name: [f"method={name}"] for name, row in ROWS.items() if row.advantages is not None},
    "forking_batch": ["method=dapo_forking", "algorithm.forking.scope=batch", f"algorithm.forking.rho={RHO}"],
    "forking_micro_batch": [
        "method=dapo_forking",
        "algorithm.forking.scope=micro_batch",
        "actor_rollout_ref.actor.calculate_entropy=true",  # the training policy's entropy selects the tokens
        f"algorithm.forking.rho={RHO}",
    ],
}


# ----------------------------------------------------------------------------------------------------------------
# model and config


def build_tokenizer():
    from gtpo.cpu.demo_task import build_tokenizer as demo_tokenizer

    return demo_tokenizer()


def build_models(seed: int = 0):
    """``(old, trained)``: a random tiny Qwen2 (the CPU demo's recipe, 256 positions for verl's 128-token padding
    rows) and a copy with Gaussian noise of std :data:`PERTURB` on every weight."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gtpo.cpu.demo_task import MODEL_RECIPE

    tok = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        bos_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **{**MODEL_RECIPE, "max_position_embeddings": 256},
    )
    torch.manual_seed(seed)
    old = Qwen2ForCausalLM(config).to(torch.float32).eval()
    trained = copy.deepcopy(old)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(PERTURB * torch.randn(p.shape, generator=gen))
    return old, trained


def write_model_dir(folder: Path, model) -> Path:
    """Save ``model`` and the tokenizer into ``folder`` (verl's ``model.path``)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer().save_pretrained(folder)
    return folder


# The padded path with fixed micro-batches: the CPU backend's remove padding, token budgets, chunked entropy and
# activation checkpointing turned off (tests/support/paths.py runs those paths against this one).
PADDED = (
    "actor_rollout_ref.model.use_remove_padding=false",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.actor.use_dynamic_bsz=false",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking=false",
)


def compose_config(method: str, model_dir: Path | str, path: tuple[str, ...] = PADDED):
    """The recipe's resolved config for ``method`` on the CPU backend: 4 prompts x 4 samples in one mini-batch,
    micro-batches of 4 rows (token budgets where ``path`` turns dynamic batch sizes on), SGD without clipping in
    effect; ``path`` selects how verl computes (default: padded, fixed micro-batches)."""
    from omegaconf import OmegaConf

    from tests.support.configs import compose

    overrides = [
        "backend=cpu_tiny",
        *METHODS[method],
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.tokenizer_path={model_dir}",
        f"data.train_batch_size={len(GROUPS)}",
        f"data.max_response_length={MAX_RESPONSE}",
        f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(GROUPS)}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO_BATCH}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={MICRO_BATCH}",
        "actor_rollout_ref.actor.optim.optimizer=SGD",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.optim.clip_grad={CLIP_GRAD}",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.optim.total_training_steps=1",
        *path,
    ]
    cfg = compose(overrides)
    OmegaConf.resolve(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# the rollout batch and the driver


def rollout_rows(tokenizer) -> tuple[list[str], list[dict], list[dict]]:
    """verl agent-loop rows (keys ``{uid}_{session}_0``, fields and tags as ``AgentLoopWorkerTQ`` stores them)."""
    gen = torch.Generator().manual_seed(1234)
    low, high = 4, len(tokenizer)  # word tokens only; ids 0-3 are special
    keys, rows, tags = [], [], []
    for g, (prompt_len, response_lens, rewards) in enumerate(GROUPS):
        uid = f"prompt{g}"
        prompt = torch.randint(low, high, (prompt_len,), generator=gen)
        for s, (r_len, reward) in enumerate(zip(response_lens, rewards, strict=True)):
            response = torch.randint(low, high, (r_len,), generator=gen)
            if r_len < MAX_RESPONSE:
                response[-1] = tokenizer.eos_token_id  # finished; a MAX_RESPONSE response is truncated
            input_ids = torch.cat([prompt, response])
            rm_scores = torch.zeros(r_len, dtype=torch.float32)
            rm_scores[-1] = reward
            keys.append(f"{uid}_{s}_0")
            rows.append(
                {
                    "prompts": prompt.clone(),
                    "responses": response,
                    "response_mask": torch.ones(r_len, dtype=torch.int64),
                    "loss_mask": torch.ones(r_len, dtype=torch.int64),
                    "input_ids": input_ids,
                    "attention_mask": torch.ones_like(input_ids),
                    "position_ids": torch.arange(len(input_ids)),
                    "rm_scores": rm_scores,
                    # uniform: only verl's rollout-vs-actor metrics and its no-op rollout correction read them here
                    "rollout_log_probs": torch.full((r_len,), -math.log(len(tokenizer))),
                    "num_turns": 2,
                    "uid": uid,
                    "session_id": s,
                }
            )
            tags.append(
                {
                    "status": "success",
                    "prompt_len": prompt_len,
                    "response_len": r_len,
                    "seq_len": prompt_len + r_len,
                    "global_steps": 1,
                }
            )
    return keys, rows, tags


def to_tensordict(rows: list[dict], nested: set[str]):
    """TensorDict of ``rows`` as TransferQueue returns it: a field whose shape varies over the stored rows is a
    jagged nested tensor, other tensors are stacked, non-tensors a ``NonTensorStack``."""
    from tensordict import NonTensorStack, TensorDict

    out = {}
    for name in rows[0]:
        values = [row[name] for row in rows]
        if not isinstance(values[0], torch.Tensor):
            out[name] = NonTensorStack(*values)
        elif name in nested:
            out[name] = torch.nested.as_nested_tensor(values, layout=torch.jagged)
        else:
            out[name] = torch.stack(values)
    return TensorDict(out, batch_size=[len(rows)])


class MemoryTQ:
    """``kv_batch_get`` / ``kv_batch_put`` of TransferQueue over a dict (one partition; the driver's only calls)."""

    def __init__(self):
        self.rows: dict[str, dict[str, Any]] = {}
        self.tags: dict[str, dict] = {}

    def nested_fields(self) -> set[str]:
        shapes: dict[str, set] = {}
        for row in self.rows.values():
            for name, value in row.items():
                if isinstance(value, torch.Tensor):
                    shapes.setdefault(name, set()).add(tuple(value.shape))
        return {name for name, s in shapes.items() if len(s) > 1}

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None, **kwargs):
        from tensordict import NonTensorData, NonTensorStack
        from transfer_queue import KVBatchMeta

        for i, key in enumerate(keys):
            row = self.rows.setdefault(key, {})
            for name in fields.keys() if fields is not None else ():
                value = fields.get(name)
                if isinstance(value, NonTensorStack):
                    row[name] = value.tolist()[i]
                elif isinstance(value, NonTensorData):
                    row[name] = value.data
                elif value.is_nested:
                    row[name] = value.unbind()[i].clone()
                else:
                    row[name] = value[i].clone()
            if tags is not None:
                self.tags[key] = {**self.tags.get(key, {}), **tags[i]}
        names = sorted({name for key in keys for name in self.rows[key]})
        return KVBatchMeta(
            keys=list(keys), tags=[self.tags[k] for k in keys], partition_id=partition_id, fields=names, extra_info={}
        )

    def get_rows(self, keys, select_fields=None) -> list[dict]:
        if isinstance(keys, str):
            keys = [keys]
        if isinstance(select_fields, str):
            select_fields = [select_fields]
        names = list(select_fields) if select_fields is not None else list(self.rows[keys[0]])
        return [{n: self.rows[k][n] for n in names if n in self.rows[k]} for k in keys]

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        return to_tensordict(self.get_rows(keys, select_fields), self.nested_fields())


@contextmanager
def patched_tq(store: MemoryTQ):
    """verl's and the recipe's driver modules talk to ``store`` instead of TransferQueue."""
    import verl.trainer.ppo.padding_utils as padding_utils
    import verl.trainer.ppo.v1.trainer_base as trainer_base

    import gtpo.trainer.advantage as advantage

    modules = (padding_utils, trainer_base, advantage)
    saved = [m.tq for m in modules]
    for m in modules:
        m.tq = store
    try:
        yield
    finally:
        for m, tq in zip(modules, saved, strict=True):
            m.tq = tq


@torch.no_grad()
def sequence_log_probs(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position ``i``: ``log p(token_{i+1})`` and the entropy of the next-token distribution (last position 0),
    the layout of the actor's ``log_probs`` / ``entropy`` outputs before ``response_from_nested``."""
    logits = model(input_ids=input_ids[None]).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = torch.zeros(len(input_ids))
    token_logp[:-1] = logp[:-1].gather(-1, input_ids[1:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    entropy[-1] = 0.0
    return token_logp, entropy


def response_log_probs(model, row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s log-probs of ``row``'s response tokens and the entropies at those positions (``[len]`` each)."""
    log_probs, entropy = sequence_log_probs(model, row["input_ids"])
    start, n = len(row["prompts"]) - 1, len(row["responses"])
    return log_probs[start : start + n], entropy[start : start + n]


class DriverWorkerGroup:
    """The actor worker group as the driver sees it: ``compute_log_prob`` from an HF forward of the old policy,
    ``update_actor`` captures the batch verl would dispatch."""

    def __init__(self, dp: int, store: MemoryTQ, old_model):
        self._dispatch_info = {"actor": list(range(dp))}
        self.store = store
        self.old_model = old_model
        self.sent = None

    def compute_log_prob(self, batch):
        log_probs, entropies = [], []
        for row in self.store.get_rows(batch.keys, ["input_ids"]):
            lp, ent = sequence_log_probs(self.old_model, row["input_ids"])
            log_probs.append(lp)
            entropies.append(ent)
        fields = to_tensordict(
            [{"log_probs": lp, "entropy": ent} for lp, ent in zip(log_probs, entropies, strict=True)],
            {"log_probs", "entropy"},
        )
        self.store.kv_batch_put(batch.keys, batch.partition_id, fields=fields)
        return batch

    def update_actor(self, batch):
        self.sent = copy.deepcopy(batch)
        return {"metrics": {"mfu": 0.0}}


@dataclass
class DriverBatch:
    """What the driver hands the actor workers for one step, and what it computed on the way."""

    keys: list[str]  # in dispatch order
    tags: list[dict]
    rows: dict[str, dict]  # key -> every stored field
    extra_info: dict
    nested: set[str]
    metrics: dict
    dp: int

    @classmethod
    def dispatched(cls, sent, store: MemoryTQ, metrics: dict, dp: int) -> DriverBatch:
        """The batch ``sent`` to the actor (``KVBatchMeta``) with every field ``store`` holds for its rows."""
        return cls(
            keys=list(sent.keys),
            tags=list(sent.tags),
            rows={k: store.rows[k] for k in sent.keys},
            extra_info=dict(sent.extra_info),
            nested=store.nested_fields(),
            metrics=metrics,
            dp=dp,
        )

    def rank_keys(self, rank: int) -> list[str]:
        from transfer_queue import KVBatchMeta

        return KVBatchMeta(keys=self.keys, tags=self.tags).chunk(self.dp)[rank].keys

    def rank_rows(self, rank: int) -> list[dict]:
        return [self.rows[k] for k in self.rank_keys(rank)]

    def real_keys(self) -> list[str]:
        return [k for k, t in zip(self.keys, self.tags, strict=True) if not t.get("is_padding", False)]


def make_driver(cfg, dp: int, store: MemoryTQ, old_model):
    """The recipe's sync trainer object with only what the steps used here read (no constructor, no Ray)."""
    from gtpo.methods import knob
    from gtpo.trainer.modes import GTPOTrainerSync

    drv = object.__new__(GTPOTrainerSync)
    drv.config = cfg
    drv.tokenizer = build_tokenizer()
    drv.use_critic = False
    drv.global_steps = 1
    drv.actor_rollout_wg = DriverWorkerGroup(dp, store, old_model)
    params = knob(cfg.algorithm, "forking")
    drv._forking = params if params.enable else None
    return drv


def driver_batch(cfg, dp: int, old_model, order: list[int] | None = None) -> DriverBatch:
    """Run the driver's steps from the rollout batch to the actor dispatch (see the module docstring).

    Args:
        cfg: :func:`compose_config`'s config.
        dp: actor data-parallel size (verl pads and balances for it).
        old_model: the policy whose log-probs and entropy the old-log-prob pass returns.
        order: optional permutation of the rollout rows as the replay buffer hands them over.
    """
    from transfer_queue import KVBatchMeta

    keys, rows, tags = rollout_rows(build_tokenizer())
    if order is not None:
        keys, rows, tags = [keys[i] for i in order], [rows[i] for i in order], [tags[i] for i in order]
    store = MemoryTQ()
    store.rows = {k: dict(r) for k, r in zip(keys, rows, strict=True)}
    store.tags = {k: dict(t) for k, t in zip(keys, tags, strict=True)}
    batch = KVBatchMeta(keys=keys, tags=tags, partition_id="train", extra_info={"temperature": 1.0})
    drv = make_driver(cfg, dp, store, old_model)
    metrics: dict = {}
    with patched_tq(store):
        batch = drv._balance_batch(batch, metrics=metrics)
        batch = drv._compute_old_log_prob(batch, metrics=metrics)
        batch = drv._compute_advantage(batch, metrics=metrics)
        drv._update_actor(batch, metrics=metrics)
    return DriverBatch.dispatched(drv.actor_rollout_wg.sent, store, metrics, dp)


def worker_input(rows: list[dict], nested: set[str], extra_info: dict):
    """A rank's ``update_actor`` argument as verl's ``tqbridge`` builds it from TransferQueue and ``extra_info``."""
    from verl.utils import tensordict_utils as tu

    td = to_tensordict(rows, nested)
    for key, val in copy.deepcopy(extra_info).items():
        tu.assign_non_tensor_data(tensor_dict=td, key=key, val=val)
    return td


def forking_micro_batch_loss(cfg, batch: DriverBatch, records: list[dict], trained) -> float:
    """The ``pg_loss`` the forking loss with ``scope=micro_batch`` must report for ``records`` (every rank's
    micro-batches of one update), recomputed from each micro-batch's forward outputs: each micro-batch keeps its own
    top-rho tokens of the training policy's entropy (``ceil(rho * n_valid)``, more only on ties at the threshold) and
    contributes ``(n_valid(mb) / N) * J(mb)``, ``J(mb)`` verl's clipped loss averaged over that selection. The
    forward outputs are checked against the trained model's own forward first (ties must resolve as in the worker,
    hence its values)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.utils.config import omega_conf_to_dataclass

    assert cfg.algorithm.forking.scope == "micro_batch"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.global_batch_info == {}  # the per-micro-batch mean below takes no global normalisation
    rho = float(cfg.algorithm.forking.rho)

    def padded(rows: list[dict], name: str, width: int) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(r[name], (0, width - len(r[name]))) for r in rows])

    total = 0.0
    for record in records:
        rows = [batch.rows[k] for k in record["rows"]]
        log_prob, entropy = record["log_probs"], record["entropy"]
        width = log_prob.shape[1]
        valid = padded(rows, "response_mask", width).bool()
        for i, row in enumerate(rows):
            own_log_prob, own_entropy = response_log_probs(trained, row)
            n = int(row["response_mask"].sum())
            torch.testing.assert_close(log_prob[i, :n], own_log_prob[:n], rtol=0, atol=1e-5)
            torch.testing.assert_close(entropy[i, :n], own_entropy[:n], rtol=0, atol=1e-5)
        n_valid = int(valid.sum())
        if n_valid == 0:
            continue
        k = math.ceil(rho * n_valid)
        tau = entropy[valid].sort(descending=True).values[k - 1]
        selected = valid & (entropy >= tau)
        n_sel = int(selected.sum())
        assert record["n_valid"] == n_valid
        assert record["forking/selected_token_frac"] == n_sel / n_valid
        if n_sel > k:  # only ties at the threshold add tokens (a prompt's rows share its first response position)
            assert int((entropy[valid] == tau).sum()) > 1
        mean_loss, _ = compute_policy_loss_vanilla(
            old_log_prob=padded(rows, "old_log_probs", width),
            log_prob=log_prob,
            advantages=padded(rows, "advantages", width),
            response_mask=selected,
            loss_agg_mode="token-mean",
            config=actor,
        )
        total += n_valid / record["batch_num_tokens"] * float(mean_loss)
    return total


# ----------------------------------------------------------------------------------------------------------------
# worker side


class RecordingLoss:
    """Wraps the actor's loss callable; records, per micro-batch, the rows (``uid``, ``session_id``), the valid
    token count, the global token count, the loss metrics, and the forward's response log-probs and entropy
    (``[rows, width]``, what the loss selects and weighs with). Changes nothing it passes on."""

    def __init__(self, inner):
        self.inner = inner
        self.records: list[dict] = []

    def __call__(self, model_output, data, dp_group=None):
        from verl.workers.utils.padding import no_padding_2_padding

        loss, metrics = self.inner(model_output=model_output, data=data, dp_group=dp_group)
        mask = data["response_mask"]
        record = {
            "rows": [f"{u}_{s}_0" for u, s in zip(list(data["uid"]), list(data["session_id"]), strict=True)],
            "n_valid": int((mask.values() if mask.is_nested else mask).sum()),
            "batch_num_tokens": float(data["batch_num_tokens"]),
            "loss": float(loss.detach()),
        }
        for name in ("log_probs", "entropy"):
            if model_output.get(name, None) is not None:
                record[name] = no_padding_2_padding(model_output[name], data).detach().cpu().clone()
        for name, value in metrics.items():
            values = getattr(value, "values", None)
            if values is not None and len(values) == 1:
                record[name] = float(values[0])
        self.records.append(record)
        return loss, metrics


@dataclass
class Job:
    """One actor update for the worker processes: the recipe config's method and each rank's input."""

    method: str
    rows_by_rank: list[list[dict]]
    nested: set[str]
    extra_info: dict


@dataclass
class RankResult:
    """What one rank reports for one :class:`Job`."""

    metrics: dict | None = None  # the driver's reduction of rank 0's update_actor output ("actor/..." keys)
    micro_batches: list[dict] = field(default_factory=list)
    weights: dict | None = None  # full updated parameters (rank 0)
    seconds: float = 0.0  # config, engine build and update


def _full_state(module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone().cpu()
    return out


def train_and_record(cfg, worker, data, rank: int) -> RankResult:
    """verl's ``update_actor`` on ``worker`` (model built) with the recipe's loss replacement, recording every
    micro-batch's loss inputs; rank 0 also reports the driver's reduction of the metrics and the full weights."""
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    from gtpo.verl_plugin import actor_loss

    # the recipe's loss replacement, as AdvantageHandoff.on_init_end installs it through the worker group
    actor_loss.install(SimpleNamespace(config=cfg, actor_rollout_wg=worker))
    recorder = RecordingLoss(worker.actor.loss_fn)
    worker.actor.set_loss_fn(recorder)
    out = worker.update_actor(data)
    result = RankResult(micro_batches=recorder.records)
    weights = _full_state(worker.actor.engine.module)  # collective: every rank
    if rank == 0:
        # PPOTrainer._update_actor's reduction of the collected output
        metrics = rename_dict(dict(out["metrics"]), "actor/")
        metrics.pop("actor/mfu", None)
        result.metrics = {k: float(v) for k, v in reduce_metrics(metrics).items() if _is_number(v)}
        result.weights = weights
    return result


def _update_once(cfg, job: Job, rank: int) -> RankResult:
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    return train_and_record(cfg, worker, worker_input(job.rows_by_rank[rank], job.nested, job.extra_info), rank)


def _is_number(v) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def rank_environment(rank: int, world_size: int, port: int) -> None:
    """This spawned process as rank ``rank`` of ``world_size`` on the CPU backend (gloo on 127.0.0.1:``port``), with the
    recipe's registrations loaded by verl's import, one torch thread."""
    from gtpo.cpu import env as cpu_env

    os.environ.update(cpu_env(extra_modules=("gtpo.verl_plugin.register",), base=dict(os.environ)))
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DIST_INIT_METHOD": f"tcp://127.0.0.1:{port}",
        }
    )
    torch.set_num_threads(1)


def _rank_main(rank: int, world_size: int, port: int, job_path: str, out_dir: str) -> None:
    rank_environment(rank, world_size, port)
    try:
        # verl's package import loads VERL_USE_EXTERNAL_MODULES: the cpu platform, then the recipe's registrations
        import verl  # noqa: F401

        jobs: list[Job] = torch.load(job_path, weights_only=False)
        results = {}
        for job in jobs:
            started = time.perf_counter()
            cfg = compose_config(job.method, Path(job_path).parent / "model")
            results[job.method] = _update_once(cfg, job, rank)
            results[job.method].seconds = time.perf_counter() - started
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(world_size: int, jobs: list[Job], folder: Path) -> list[multiprocessing.Process]:
    """Spawn ``world_size`` worker processes running ``jobs`` (the model must be in ``folder / "model"``)."""
    out = folder / f"dp{world_size}"
    out.mkdir(parents=True, exist_ok=True)
    job_path = folder / f"jobs_dp{world_size}.pt"
    torch.save(jobs, job_path)
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, str(job_path), str(out)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


def wait_processes(groups: dict[int, list[multiprocessing.Process]], error_dir, timeout: float) -> None:
    """Wait for every group of processes; a failed one (or the timeout) kills them all, since its peers would wait
    in a collective, and raises with the tracebacks written to ``error_dir(group)/*.error``."""
    deadline = time.monotonic() + timeout
    pending = dict(groups)
    while pending:
        for ws, procs in list(pending.items()):
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                everyone = [p for group in groups.values() for p in group]
                for p in everyone:
                    if p.is_alive():
                        p.kill()
                for p in everyone:
                    p.join(5)
                errors = sorted(Path(error_dir(ws)).glob("*.error"))
                detail = "\n".join(e.read_text() for e in errors) or "no traceback (killed or timed out)"
                raise RuntimeError(f"world size {ws}: rank processes failed:\n{detail}")
            if all(p.exitcode == 0 for p in procs):
                del pending[ws]
        time.sleep(0.2)


def wait_ranks(groups: dict[int, list[multiprocessing.Process]], folder: Path, timeout: float) -> dict[int, list]:
    """Wait for every group (:func:`wait_processes`). Returns ``{world_size: [results of rank 0, rank 1, ...]}``."""
    wait_processes(groups, lambda ws: folder / f"dp{ws}", timeout)
    return {
        ws: [torch.load(folder / f"dp{ws}" / f"rank{r}.pt", weights_only=False) for r in range(ws)] for ws in groups
    }
