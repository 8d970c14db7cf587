"""verl's Ulysses group of gloo ranks on this host, for the CPU Ulysses attention's test (tests/test_backend_parity.py):
each rank attends over its shard of one packed row through :func:`gtpo.cpu.ulysses_attention.ulysses_sdpa_attention`
and writes its output for the test to compare with one process's SDPA over the whole row."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch


def packed_row(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query (2 heads), key and value (one KV head) of 6 tokens, and position ids of two packed sequences."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 2, 6, 4, generator=gen)
    key, value = torch.randn(1, 1, 6, 4, generator=gen), torch.randn(1, 1, 6, 4, generator=gen)
    return query, key, value, torch.tensor([[0, 1, 2, 3, 0, 1]])


def rank_main(rank: int, world_size: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from gtpo.cpu.ulysses_attention import ulysses_sdpa_attention

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        set_ulysses_sequence_parallel_group(dist.new_group(list(range(world_size))))
        query, key, value, positions = packed_row()
        shard = slice(rank * 6 // world_size, (rank + 1) * 6 // world_size)
        output, _ = ulysses_sdpa_attention(
            SimpleNamespace(training=False), query[:, :, shard], key[:, :, shard], value[:, :, shard], None,
            position_ids=positions[:, shard],
        )  # fmt: skip
        torch.save(output, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
