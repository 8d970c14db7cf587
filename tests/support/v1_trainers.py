"""verl's v1 trainer classes as the recipe registers them, without workers, and their advantage step on one batch
through an in-memory stand-in for TransferQueue (``kv_batch_get`` / ``kv_batch_put`` with verl's jagged per-response
fields).
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from tests.support.configs import compose


def make_trainer(registered: str, overrides: list[str]):
    """An instance of the class registered as ``registered``, with its config set but no workers (as verl's
    ``PPOTrainer.__init__`` sets the mode first)."""
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    import gtpo.verl_plugin.register  # noqa: F401

    cls = get_trainer_cls(registered)
    trainer = cls.__new__(cls)
    trainer.config = compose(overrides)
    OmegaConf.resolve(trainer.config)
    trainer.trainer_mode = trainer.config.trainer.v1.trainer_mode
    trainer.global_steps = 3
    return trainer


class MemoryTQ:
    """``kv_batch_get`` / ``kv_batch_put`` over per-row fields; response fields come back jagged, as TQ's do."""

    def __init__(self, rows: dict[str, dict]):
        self.rows = rows

    def kv_batch_get(self, keys, partition_id, select_fields):
        from tensordict import NonTensorData, NonTensorStack, TensorDict

        out = {}
        for name in select_fields:
            if name not in self.rows[keys[0]]:
                continue  # fields nobody wrote (values, ref_log_prob, ...) are absent
            values = [self.rows[k][name] for k in keys]
            if name == "uid":
                out[name] = NonTensorStack(*[NonTensorData(v) for v in values])
            else:
                out[name] = torch.nested.nested_tensor(values, layout=torch.jagged)
        return TensorDict(out, batch_size=len(keys))

    def kv_batch_put(self, keys, partition_id, fields):
        from transfer_queue import KVBatchMeta

        for name in fields.keys():
            for key, value in zip(keys, fields[name].unbind(0), strict=True):
                self.rows[key][name] = value
        return KVBatchMeta(partition_id=partition_id, keys=list(keys), tags=[{}] * len(keys))


def tq_batch(with_entropy: bool = True):
    """Three prompt groups of four responses (mixed rewards, lengths 2..6) in TQ form; returns (rows, meta)."""
    from transfer_queue import KVBatchMeta

    gen = torch.Generator().manual_seed(7)
    lengths = [6, 3, 5, 2, 4, 6, 6, 5, 3, 4, 2, 6]
    rewards = [1.0, -1, 1, -1, -1, 1, -1, -1, 1, 1, -1, 1]
    rows = {}
    for i, (n, r) in enumerate(zip(lengths, rewards, strict=True)):
        scores = torch.zeros(n)
        scores[-1] = r
        row = {
            "uid": "abc"[i // 4],
            "response_mask": torch.ones(n, dtype=torch.int64),
            "rm_scores": scores,
            "old_log_probs": -torch.rand(n, generator=gen),
            "responses": torch.randint(0, 5, (n,), generator=gen),
        }
        if with_entropy:
            row["entropy"] = torch.rand(n, generator=gen) * 3 + 0.1
        rows[f"k{i}"] = row
    return rows, KVBatchMeta(partition_id="train", keys=list(rows), tags=[{}] * len(rows))


def compute_advantages(trainer, monkeypatch, rows, meta) -> tuple[list[torch.Tensor], dict]:
    """``trainer._compute_advantage`` on ``rows`` through a :class:`MemoryTQ`; the advantages of ``meta``'s rows and the
    step's metrics."""
    import transfer_queue

    store = MemoryTQ({k: dict(v) for k, v in rows.items()})
    monkeypatch.setattr(transfer_queue, "kv_batch_get", store.kv_batch_get)
    monkeypatch.setattr(transfer_queue, "kv_batch_put", store.kv_batch_put)
    metrics: dict = {}
    trainer._compute_advantage(meta, metrics)
    return [store.rows[k]["advantages"] for k in meta.keys], metrics
