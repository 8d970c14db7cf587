"""The kernels' row sums, and that an estimator's CPU path leaves torch's OpenMP pool alone.

A torch op that runs as an OpenMP parallel region (a row sum, even a ``[NG]`` sqrt or a gather of a few thousand
rows) leaves the pool's worker spinning after it (libgomp's default wait policy); a kernel started right after it on
Python threads then shares the second core with that worker and gains nothing from it. The sequence rewards, GROP's
lengths, the group statistics and the per-row gathers therefore run on the kernels' threads or in numpy. The check
counts the CPU time of torch's OpenMP worker thread while the adapters run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from gtpo.algorithms import kernel_dispatch
from gtpo.algorithms.group_ops import group_mean_std
from tests.conftest import REPO_ROOT


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.uint8, torch.int32, torch.int64])
@pytest.mark.parametrize("threads", [1, 2])
def test_row_sums_equal_torch(monkeypatch, dtype, threads):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(3)
    x = torch.rand(300, 37, generator=g, dtype=torch.float64) * 4 - 1
    if dtype == torch.bool:
        x = x > 0.5
    elif not dtype.is_floating_point:
        x = (x * 10).round().clamp(min=0)
    x = x.to(dtype)
    got = kernel_dispatch.row_sums(x)
    expected = x.to(torch.float64).sum(-1)
    assert got.shape == (300,)
    assert got.dtype == (dtype if dtype.is_floating_point else torch.float64)
    torch.testing.assert_close(got.to(torch.float64), expected, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6)


def test_row_sums_of_a_view_a_cuda_like_fallback_and_empty_shapes():
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert kernel_dispatch.row_sums(x[:, ::2]).tolist() == x[:, ::2].sum(-1).tolist()  # non-contiguous
    assert kernel_dispatch.row_sums(x.t()).tolist() == x.t().sum(-1).tolist()
    assert kernel_dispatch.row_sums(torch.zeros(0, 5)).shape == (0,)
    assert kernel_dispatch.row_sums(torch.zeros(3, 0)).tolist() == [0.0, 0.0, 0.0]
    half = torch.ones(2, 3, dtype=torch.float16)  # not a kernel dtype: torch's own sum, same dtype
    assert kernel_dispatch.row_sums(half).dtype == torch.float16 and half.sum(-1).tolist() == [3.0, 3.0]


def test_group_std_matches_torch_std_and_keeps_gradients():
    values = torch.tensor([1.0, 4.0, 2.0, 8.0, 5.0], dtype=torch.float64, requires_grad=True)
    gid = torch.tensor([0, 0, 1, 1, 1])
    mean, std, count = group_mean_std(values, gid, 2)
    assert torch.allclose(std, torch.stack([values[:2].std(), values[2:].std()]))
    std.sum().backward()  # the sqrt of a tensor that needs a gradient stays torch's
    assert values.grad is not None and torch.isfinite(values.grad).all()


_PROBE = r"""
import json, os, sys
import torch
torch.set_num_threads(2)
before = set(os.listdir("/proc/self/task"))
torch.ones(1 << 22).sum()  # starts torch's OpenMP pool
workers = set(os.listdir("/proc/self/task")) - before

def ticks():
    total = 0
    for tid in workers:
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total

sys.path.insert(0, os.getcwd())
from benchmarks.bench_estimators import make_call, make_inputs
rows, length = map(int, sys.argv[1].split("x"))
inp = make_inputs(rows, length, "cpu", True)
out = {"workers": len(workers)}
for case in sys.argv[2:]:
    call = make_call(case, inp)
    call()
    start = ticks()
    for _ in range(10):
        call()
    out[case] = ticks() - start
print(json.dumps(out))
"""


@pytest.mark.parametrize("size", ["512x2048", "8192x256"])
def test_estimators_leave_torchs_openmp_pool_idle(size):
    """Ten calls of each adapter at two threads: torch's OpenMP worker gets at most one clock tick (10 ms) of CPU.

    Before the row sums, the group statistics and GROP's per-row gathers left torch, the worker spun for several
    milliseconds per call (512 rows: the sums, the sqrt, a small output; 8192 rows: also every ``x[gid]``).
    """
    cases = ["gtpo_zero_fill", "gtpo_grop", "gtpo_split", "grpo_s", "gtpo_traj"]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, size, *cases], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["workers"]:
        pytest.skip("this torch starts no OpenMP worker thread")
    spun = {case: result[case] for case in cases if result[case] > 1}
    assert not spun, f"torch's OpenMP worker ran (clock ticks over 10 calls): {spun}"


def test_the_benchmark_floor_uses_the_bandwidth_of_its_own_thread_count(monkeypatch):
    """bench_estimators measures the copy bandwidth at each thread count it runs (a one-thread row's floor is the
    one-thread bandwidth), and leaves torch's thread count as it found it."""
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks import bench_estimators

    seen = []
    monkeypatch.setattr(bench_estimators, "_copy_bandwidth", lambda device, mb: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    for threads in (1, 2, None):
        bench_estimators.copy_bandwidth("cpu", threads)
    assert seen == [1, 2, before]
    assert torch.get_num_threads() == before
