"""What tool outputs inside the responses cost the estimators (docs/ALGORITHMS.md §13).

The same batch twice: right-padded responses of 1/4 to all of ``L`` tokens, then the same rows with two tool outputs
of ``--tool-tokens`` masked tokens inside each response (at a third and two thirds of its length). The entry points
(``gtpo_token_advantages``, ``grpo_s_advantages``, ``gtpo_traj_advantages``) with their default knobs; the median of
``--repeats`` timed calls after one warm-up call, on CPU.

``--index-path`` moves the tokens with the token indices (the layout's path off CPU) instead of the compiled passes.

Usage: .venv/bin/python benchmarks/bench_tool_positions.py [--size 8192x4096] [--threads 1] [--repeats 7] [--index-path]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gtpo.algorithms import kernel_dispatch
from gtpo.algorithms.grpo_s import grpo_s_advantages
from gtpo.algorithms.gtpo_token import GTPOParams, gtpo_token_advantages
from gtpo.algorithms.gtpo_traj import GTPOTrajParams, gtpo_traj_advantages

GROUP = 16


def batches(rows: int, length: int, tool_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (rows,), generator=gen)
    single = (torch.arange(length)[None, :] < lengths[:, None]).float()
    multi = single.clone()
    for frac in (1 / 3, 2 / 3):
        cols = (lengths.float() * frac).long()[:, None] + torch.arange(tool_tokens)[None, :]
        multi.scatter_(1, cols.clamp(max=length - 1), 0.0)
    entropy = (torch.rand(rows, length, generator=gen) * 3).to(torch.bfloat16).float()
    rewards = torch.where(torch.rand(rows, generator=gen) < 0.5, 1.0, -1.0)
    ids = torch.randint(0, 3, (rows, length), generator=gen)
    return single, multi, entropy, rewards, torch.arange(rows) // GROUP, ids


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="8192x4096", help="B x L")
    p.add_argument("--tool-tokens", type=int, default=100, help="tokens of each of the two tool outputs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--index-path", action="store_true", help="the token indices instead of the compiled compaction")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.index_path:
        kernel_dispatch._OFF.add("compact_rows")
    rows, length = (int(x) for x in args.size.split("x"))
    single, multi, entropy, rewards, gid, ids = batches(rows, length, args.tool_tokens)
    groups = rows // GROUP
    cases = {
        "gtpo": lambda m: gtpo_token_advantages(entropy, m, rewards, gid, groups, GTPOParams()),
        "grpo_s": lambda m: grpo_s_advantages(entropy, m, rewards, gid, groups),
        "gtpo_traj": lambda m: gtpo_traj_advantages(
            entropy, m, rewards, gid, groups, GTPOTrajParams(h_ini=2.0), responses=ids
        ),  # fmt: skip
    }
    path = "token indices" if args.index_path else "compiled compaction"
    print(f"{args.size}, {args.threads} thread(s), two tool outputs of {args.tool_tokens} tokens per response, {path}")
    for name, fn in cases.items():
        plain = median_ms(lambda fn=fn: fn(single), args.repeats)
        tools = median_ms(lambda fn=fn: fn(multi), args.repeats)
        print(f"{name:<10} without tool outputs {plain:8.1f} ms   with them {tools:8.1f} ms", flush=True)


if __name__ == "__main__":
    main()
