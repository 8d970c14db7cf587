"""The CPU checkpoint engine ``cpu_gloo`` (gtpo.cpu.checkpoint_engine) without Ray or the trainer.

The test process plays actor rank 0 (the sender); two forked processes play two rollout workers. Each sync runs
verl's order of calls (prepare, build_topology, init_process_group, send / receive, finalize), twice, over a bucket
far smaller than the weights, and the receivers' tensors must equal the sent ones bit for bit:

    .venv/bin/python -m pytest -q tests/test_cpu_checkpoint_engine.py
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle

import pytest
import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry

from gtpo.cpu.checkpoint_engine import BACKEND, CPUGlooCheckpointEngine

BUCKET = 512  # bytes: the embedding below (1,628 bytes) spans four chunks, the whole set five buckets
RECEIVERS = 2
ROUNDS = 2
TIMEOUT_S = 30.0


@pytest.fixture()
def cpu_platform(monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")


def weights(round_index: int) -> list[tuple[str, torch.Tensor]]:
    """A model-like state dict: a tensor larger than the bucket, odd byte sizes, every dtype family, a 0-d tensor,
    a non-contiguous view and a parameter that requires grad."""
    g = torch.Generator().manual_seed(round_index)
    return [
        ("model.embed_tokens.weight", torch.randn(37, 11, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.nn.Parameter(torch.randn(4, 7, generator=g))),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(6, 5, generator=g).t()),
        ("model.norm.weight", torch.randn(3, generator=g).to(torch.float16)),
        ("rotary.inv_freq", torch.randn(7, generator=g).to(torch.float64)),
        ("position_ids", torch.arange(9, dtype=torch.int64) + round_index),
        ("attention_mask", torch.rand(13, generator=g) > 0.5),
        ("logit_scale", torch.tensor(2.5 + round_index, dtype=torch.float32)),
    ]


async def _collect(stream) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.clone()) async for name, tensor in stream]


def _receiver(topology: multiprocessing.Queue, results: multiprocessing.Queue) -> None:
    """A rollout worker: each round, join the group the sender describes and report what arrived."""
    torch.set_num_threads(1)
    try:
        engine = CPUGlooCheckpointEngine(bucket_size=BUCKET, timeout_s=TIMEOUT_S)
        for round_index in range(ROUNDS):
            kwargs = topology.get(timeout=TIMEOUT_S)
            assert engine.prepare() == {"master": False}
            engine.init_process_group(**kwargs)
            received = asyncio.run(_collect(engine.receive_weights(global_steps=round_index)))
            engine.finalize()
            results.put(pickle.dumps((kwargs["rank"], round_index, received)))
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        results.put(pickle.dumps(("error", repr(err), None)))


def test_registered_under_its_backend_name():
    assert CheckpointEngineRegistry.get(BACKEND) is CPUGlooCheckpointEngine


def test_refused_without_the_cpu_platform(monkeypatch):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    with pytest.raises(RuntimeError, match=r"runs only with VERL_PLATFORM=cpu \(found VERL_PLATFORM=None\)"):
        CPUGlooCheckpointEngine(bucket_size=BUCKET, is_master=True)
    monkeypatch.setenv("VERL_PLATFORM", "cuda")
    with pytest.raises(RuntimeError, match=r"found VERL_PLATFORM='cuda'.*backend=nccl"):
        CPUGlooCheckpointEngine.build_topology(1, 1, [{"master": True, "host": "127.0.0.1", "port": 1}, {}])


def test_topology_sends_from_actor_rank_zero_only(cpu_platform):
    master = {"master": True, "host": "10.0.0.1", "port": 29500}
    metadata = [master, {"master": False}] + [{"master": False}] * 3
    actor, rollout = CPUGlooCheckpointEngine.build_topology(2, 3, metadata)
    assert actor == {"rank": [0, -1], "world_size": [4, 4], "host": ["10.0.0.1"] * 2, "port": [29500] * 2}
    assert rollout == {"rank": [1, 2, 3], "world_size": [4] * 3, "host": ["10.0.0.1"] * 3, "port": [29500] * 3}
    with pytest.raises(RuntimeError, match="actor rank 0 must be the sender"):
        CPUGlooCheckpointEngine.build_topology(2, 3, metadata[::-1])


def test_actor_ranks_outside_the_group_still_walk_the_weights(cpu_platform):
    engine = CPUGlooCheckpointEngine(bucket_size=BUCKET)
    with pytest.raises(RuntimeError, match="init_process_group must run before"):
        asyncio.run(engine.send_weights(iter(weights(0))))
    engine.init_process_group(rank=-1, world_size=3, host="127.0.0.1", port=1)
    walked = []

    def walk():
        for name, tensor in weights(0):
            walked.append(name)
            yield name, tensor

    asyncio.run(engine.send_weights(walk()))
    assert walked == [name for name, _ in weights(0)]


def test_weights_arrive_intact_over_gloo_in_several_buckets(cpu_platform):
    context = multiprocessing.get_context("fork")  # the children reuse this process's imports (verl takes seconds)
    topologies = [context.Queue() for _ in range(RECEIVERS)]
    results = context.Queue()
    children = [context.Process(target=_receiver, args=(queue, results), daemon=True) for queue in topologies]
    for child in children:
        child.start()
    try:
        sender = CPUGlooCheckpointEngine(bucket_size=BUCKET, is_master=True, timeout_s=TIMEOUT_S)
        sent_buckets = []
        send_bucket = sender._send_bucket

        def counted(length, *rest):
            sent_buckets.append(length)
            send_bucket(length, *rest)

        sender._send_bucket = counted

        for round_index in range(ROUNDS):
            metadata = [sender.prepare()] + [{"master": False}] * RECEIVERS
            actor_kwargs, rollout_kwargs = CPUGlooCheckpointEngine.build_topology(1, RECEIVERS, metadata)
            for i, queue in enumerate(topologies):
                queue.put({key: values[i] for key, values in rollout_kwargs.items()})
            sender.init_process_group(**{key: values[0] for key, values in actor_kwargs.items()})
            asyncio.run(sender.send_weights(iter(weights(round_index)), global_steps=round_index))
            sender.finalize()

            expected = [(name, tensor.detach().contiguous()) for name, tensor in weights(round_index)]
            reports = [pickle.loads(results.get(timeout=TIMEOUT_S)) for _ in range(RECEIVERS)]
            errors = [report[1] for report in reports if report[0] == "error"]
            assert not errors, errors
            assert sorted((rank, index) for rank, index, _ in reports) == [(1, round_index), (2, round_index)]
            for rank, _, received in reports:
                assert [name for name, _ in received] == [name for name, _ in expected], rank
                for (name, got), (_, want) in zip(received, expected, strict=True):
                    assert (got.dtype, got.shape) == (want.dtype, want.shape), (rank, name)
                    assert torch.equal(got, want), (rank, name)
    finally:
        for child in children:
            child.join(timeout=TIMEOUT_S)
            if child.is_alive():
                child.kill()
    assert [child.exitcode for child in children] == [0] * RECEIVERS
    # per round: the embedding's first three chunks fill three buckets; its last 92 bytes and the next five tensors
    # (each placed at a multiple of 16 bytes) make 440; the int64 ids no longer fit, and go with the rest (100)
    assert sent_buckets == [512, 512, 512, 440, 100] * ROUNDS
