"""SDPA attention that honours verl's Ulysses sequence parallelism, for the CPU backend (tests and demos only).

verl 0.9.1 implements Ulysses by wrapping flash-attention only: ``apply_monkey_patch`` replaces transformers'
``_flash_attention_forward`` with ``_ulysses_flash_attention_forward`` (``verl/models/transformers/monkey_patch.py``),
which all-to-alls each rank's sequence shard into whole sequences over a share of the heads. Under any other
attention implementation the wrapper is never called, so each rank attends only within its own shard of the packed
sequence: the run goes on and every log-prob and entropy after the first shard boundary is wrong (measured on the
CPU backend's SDPA, ``tests/test_path_equivalence.py``: old log-probs off by up to 0.13). flash-attention does not
run on a CPU, so the CPU backend selects this implementation, ``gtpo_cpu_sdpa``, instead of ``sdpa``:

* without Ulysses (``sp == 1``) it is transformers' SDPA attention, unchanged;
* with Ulysses it does what verl's wrapper does around flash-attention (repeat the KV heads up to the SP size, gather
  the sequence and scatter the heads with verl's own all-to-all, gather the position ids), runs SDPA over the whole
  packed sequence with a causal mask that stops at each sequence start (position id 0), and scatters back.

GPU runs use flash-attention and verl's own wrapper; ``gtpo.launch`` refuses Ulysses with any attention implementation
that verl's wrapper does not cover.
"""

from __future__ import annotations

NAME = "gtpo_cpu_sdpa"

__all__ = ["NAME", "packed_causal_mask", "register", "ulysses_sdpa_attention"]


def packed_causal_mask(position_ids):
    """``[batch, 1, seq, seq]`` boolean mask: causal, and no attention across a sequence start (position id 0).

    Args:
        position_ids: ``[batch, seq]`` position ids of a packed row (each sequence counts from 0).
    """
    import torch

    segment = torch.cumsum(position_ids == 0, dim=-1)
    same = segment[:, :, None] == segment[:, None, :]
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def ulysses_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function (query ``[batch, heads, seq/sp, head_dim]``, keys and values with the model's
    KV heads); returns ``([batch, seq/sp, heads, head_dim], None)`` as transformers' SDPA does."""
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
    from verl.utils.ulysses import (
        gather_heads_scatter_seq,
        gather_seq_scatter_heads,
        get_ulysses_sequence_parallel_group,
        get_ulysses_sequence_parallel_world_size,
    )

    sp = get_ulysses_sequence_parallel_world_size()
    position_ids = kwargs.get("position_ids")
    if sp <= 1 or position_ids is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # the KV heads must split over the SP ranks (verl's wrapper repeats them the same way)
    repeats = max(sp // key.size(1), 1)
    key, value = repeat_kv(key, repeats), repeat_kv(value, repeats)
    query = gather_seq_scatter_heads(query, seq_dim=2, head_dim=1)
    key = gather_seq_scatter_heads(key, seq_dim=2, head_dim=1)
    value = gather_seq_scatter_heads(value, seq_dim=2, head_dim=1)
    groups = query.size(1) // key.size(1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    shards = [torch.empty_like(position_ids) for _ in range(sp)]
    torch.distributed.all_gather(shards, position_ids.contiguous(), group=get_ulysses_sequence_parallel_group())
    mask = packed_causal_mask(torch.cat(shards, dim=-1))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling
    )
    out = gather_heads_scatter_seq(out, seq_dim=2, head_dim=1)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation=gtpo_cpu_sdpa`` known to transformers (attention and mask; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, ulysses_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
