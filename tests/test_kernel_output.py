"""The kernels' outputs (gtpo/algorithms/kernels.py, ``kernel_output``): every element written, memory recycled.

    .venv/bin/python -m pytest -q tests/test_kernel_output.py

A kernel's output is not zeroed memory: a large one is the memory of an earlier output, freed and kept for the next
call. So each write pass must write every element of its rows, the zeros of padding and of empty rows included.
Here the outputs are handed out full of NaN, and each estimator must still equal its float64 definition; and a
recycled buffer is never one that a tensor, view, numpy array or storage still holds, nor one of another size, and
outputs under 8 MiB are not pooled at all.
"""

from __future__ import annotations

import math

import pytest
import torch

from gtpo.algorithms import kernels
from gtpo.algorithms.grpo_s import GRPOSParams, grpo_s_advantages, grpo_s_definition
from gtpo.algorithms.gtpo_token import GTPOParams, gtpo_token_advantages, gtpo_token_definition
from gtpo.algorithms.gtpo_traj import GTPOTrajParams, centred_advantages, gtpo_traj_definition, trajectory
from tests.support.estimators import assert_same, random_batch, random_traj_batch


@pytest.fixture
def nan_outputs(monkeypatch):
    """Every kernel output starts as NaN; returns the list of outputs handed out."""
    handed = []

    def garbage(rows, cols):
        out = torch.full((rows, cols), float("nan"))
        handed.append(out)
        return out

    monkeypatch.setattr(kernels, "kernel_output", garbage)
    return handed


@pytest.fixture
def empty_pool():
    kernels._OUTPUTS.clear()
    yield kernels._OUTPUTS
    kernels._OUTPUTS.clear()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"norm_mode": "split"},
        {"norm_mode": "joint", "norm_scope": "group"},
        {"weight_scope": "group"},
        {"weight_scope": "group", "norm_scope": "group"},
        {"conflict_mask": True},
        {"conflict_mask": True, "weight_scope": "group"},
    ],
)
def test_gtpo_writes_every_element(nan_outputs, monkeypatch, knobs, threads):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    entropy, mask, rewards, gid, groups, responses, offset = random_batch(5, groups=40, length=29, holes=True)
    assert (mask.sum(-1) == 0).any()  # empty rows, dense rows and rows with holes
    params = GTPOParams(**knobs, position="raw")  # the kernel's sparse rows, read as columns like the definition
    got = gtpo_token_advantages(entropy, mask, rewards, gid, groups, params, offset, responses)
    assert len(nan_outputs) == 1 and got[0].data_ptr() == nan_outputs[0].data_ptr()  # the kernel wrote it
    assert_same(got, gtpo_token_definition(entropy, mask, rewards, gid, groups, params, offset, responses))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("norm_mode", ["zero_fill", "joint"])
def test_grpo_s_writes_every_element(nan_outputs, monkeypatch, norm_mode, threads):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    entropy, mask, rewards, gid, groups, _, offset = random_batch(6, groups=40, length=29, holes=True)
    params = GRPOSParams(norm_mode=norm_mode)
    adv, _ = grpo_s_advantages(entropy, mask, rewards, gid, groups, params, reward_offset=offset)
    ref, _ = grpo_s_definition(entropy, mask, rewards, gid, groups, params, reward_offset=offset)
    assert len(nan_outputs) == 1
    torch.testing.assert_close(adv, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_gtpo_traj_writes_every_element(nan_outputs, seed):
    scores, mask, ids, ent, gid, ng = random_traj_batch(seed)
    params = GTPOTrajParams(tau=0.6 if seed % 2 else math.inf, lam_neg=0.5)
    out = trajectory(scores, mask, ids, ent, gid, ng, params, 0.5)
    adv, pol, zv = centred_advantages(scores, gid, ng, params.adv_norm, params.eps)
    ref = gtpo_traj_definition(mask, ids, ent, gid, ng, params, adv, pol, zv, 0.5)
    assert len(nan_outputs) == 1
    torch.testing.assert_close(out.advantages, ref.advantages, rtol=1e-6, atol=1e-7)


def _large_grpo_s_batch(seed, rows=1024, length=2048):
    """A batch whose ``[rows, length]`` float32 output (8 MB) takes the recycled mapping."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    entropy = torch.where(mask.bool(), torch.rand(rows, length, generator=gen), float("nan"))
    rewards = torch.where(torch.rand(rows, generator=gen) < 0.4, 1.0, 0.0)
    gid = torch.arange(rows) % 64
    return entropy, mask, rewards, gid, 64


def test_a_freed_output_is_recycled_and_fully_rewritten(empty_pool):
    first = _large_grpo_s_batch(0)
    adv, _ = grpo_s_advantages(*first)
    assert adv.numel() * 4 >= kernels._HUGE_OUTPUT_BYTES
    address = adv.data_ptr()
    del adv
    assert len(empty_pool._free) == 1
    second = _large_grpo_s_batch(1)  # other lengths: the first output's values sit on the second's padding
    adv, _ = grpo_s_advantages(*second)
    assert adv.data_ptr() == address
    torch.testing.assert_close(adv, grpo_s_definition(*second)[0], rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(adv[second[1] == 0]) == 0


def test_an_output_in_use_is_never_handed_out_again(empty_pool):
    batch = _large_grpo_s_batch(2)
    adv, _ = grpo_s_advantages(*batch)
    kept = adv[3:7].clone()
    view = adv[3:7]  # a view holds the memory as the tensor does
    address = adv.data_ptr()
    del adv
    assert len(empty_pool._free) == 0
    again, _ = grpo_s_advantages(*_large_grpo_s_batch(3))
    assert again.data_ptr() != address
    assert torch.equal(view, kept)
    del view
    assert len(empty_pool._free) == 1
    del again
    assert len(empty_pool._free) == 2  # two outputs freed; the pool keeps at most two


def test_the_pool_keeps_at_most_two_buffers_and_drops_other_sizes(empty_pool):
    outputs = [kernels.kernel_output(1024, 2048) for _ in range(4)]
    assert len({o.data_ptr() for o in outputs}) == 4
    del outputs
    assert len(empty_pool._free) == empty_pool.keep == 2
    other = kernels.kernel_output(1024, 4096)  # another size: the free buffers are dropped, a new mapping made
    assert other.shape == (1024, 4096) and len(empty_pool._free) == 0
    small = kernels.kernel_output(3, 5)  # under 8 MB: numpy's allocation, never pooled
    del small
    assert len(empty_pool._free) == 0


def test_a_freed_output_of_another_size_is_never_handed_out(empty_pool):
    big = kernels.kernel_output(1024, 4096)
    del big
    assert [len(b) for b in empty_pool._free] == [1024 * 4096 * 4]
    smaller = kernels.kernel_output(1024, 2048)  # the larger free buffer is dropped, not reused
    assert smaller.shape == (1024, 2048) and smaller.dtype == torch.float32 and smaller.is_contiguous()
    assert smaller.untyped_storage().nbytes() == 1024 * 2048 * 4 and len(empty_pool._free) == 0
    del smaller
    assert [len(b) for b in empty_pool._free] == [1024 * 2048 * 4]
    larger = kernels.kernel_output(2048, 2048)
    assert larger.shape == (2048, 2048) and larger.untyped_storage().nbytes() == 2048 * 2048 * 4
    larger.fill_(1.0)  # every byte of it is writable memory of its own
    assert len(empty_pool._free) == 0


def test_a_size_change_drops_the_free_buffers_of_the_old_size(empty_pool):
    old, new = kernels.kernel_output(1024, 2048), kernels.kernel_output(1024, 4096)
    address = new.data_ptr()
    del old, new  # freed in this order
    again = kernels.kernel_output(1024, 4096)
    assert again.data_ptr() == address and len(empty_pool._free) == 0  # the old size's buffer is not kept


def test_an_output_of_the_same_size_gets_the_freed_memory(empty_pool):
    first = kernels.kernel_output(1024, 2048)
    first[-1, -1] = 7.0
    address = first.data_ptr()
    del first
    again = kernels.kernel_output(2048, 1024)  # same bytes, other shape: the memory is recycled
    assert again.data_ptr() == address and again.shape == (2048, 1024) and len(empty_pool._free) == 0
    assert again[-1, -1] == 7.0  # not zeroed: the last output's values


@pytest.mark.parametrize("hold", ["numpy", "detach", "untyped_storage", "row"])
def test_memory_held_another_way_is_never_handed_out(empty_pool, hold):
    out = kernels.kernel_output(1024, 2048)
    out.fill_(3.0)
    address = out.data_ptr()
    held = {
        "numpy": lambda t: t.numpy(),
        "detach": lambda t: t.detach(),
        "untyped_storage": lambda t: t.untyped_storage(),
        "row": lambda t: t[-1],
    }[hold](out)
    del out
    assert len(empty_pool._free) == 0
    other = kernels.kernel_output(1024, 2048)
    assert other.data_ptr() != address
    other.fill_(-1.0)
    seen = torch.empty(0).set_(held) if hold == "untyped_storage" else torch.as_tensor(held)
    assert seen.numel() in (2048, 1024 * 2048) and bool((seen == 3.0).all())  # the other output wrote elsewhere
    del held, seen
    assert len(empty_pool._free) == 1
    assert kernels.kernel_output(1024, 2048).data_ptr() == address


@pytest.mark.parametrize(
    "rows,cols,pooled",
    [
        (3, 5, False),
        (512, 512, False),  # 1 MiB
        (1, (8 << 20) // 4 - 1, False),  # 4 bytes under 8 MiB
        (1, (8 << 20) // 4, True),  # exactly 8 MiB
        (1024, 2048, True),
    ],
)
def test_outputs_from_8_mib_are_pooled_and_smaller_ones_are_not(empty_pool, rows, cols, pooled):
    assert kernels._HUGE_OUTPUT_BYTES == 8 << 20
    out = kernels.kernel_output(rows, cols)
    assert out.shape == (rows, cols) and out.dtype == torch.float32 and out.is_contiguous()
    del out
    assert len(empty_pool._free) == int(pooled)
