"""GTPO-token's compiled kernel (gtpo/algorithms/kernels.py) against its definition (gtpo_token.py).

    .venv/bin/python -m pytest -q tests/test_gtpo_kernel.py

Every mode and scope, conflict weights, GROP-like offsets with alpha1 != 1, masks with holes (read as columns,
``position=raw``; the other positions are the layouts of tests/test_tool_positions.py), every mask dtype, threads,
the recycled large outputs, the fallback to the definition and the compile-time diagnostic.
"""

from __future__ import annotations

import importlib.abc
import json
import subprocess
import sys
import warnings

import pytest
import torch

from gtpo.algorithms import kernel_dispatch, kernels
from gtpo.algorithms.gtpo_token import GTPOParams, gtpo_shaped_rewards, gtpo_token_advantages, gtpo_token_definition
from tests.conftest import REPO_ROOT
from tests.support.estimators import assert_same, random_batch


@pytest.mark.parametrize("norm_mode", ["zero_fill", "split", "joint"])
@pytest.mark.parametrize("norm_scope", ["batch", "group"])
@pytest.mark.parametrize("weight_scope", ["batch", "group"])
@pytest.mark.parametrize("conflict_mask", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_definition(norm_mode, norm_scope, weight_scope, conflict_mask, seed):
    entropy, mask, rewards, gid, groups, responses, offset = random_batch(seed, holes=seed == 2)
    params = GTPOParams(
        alpha1=0.7, alpha2=0.1 + 0.2 * seed, norm_mode=norm_mode, norm_scope=norm_scope, weight_scope=weight_scope,
        conflict_mask=conflict_mask, std="population" if seed == 1 else "unbiased", position="raw",
    )  # fmt: skip
    offset = offset if seed != 1 else None
    kernel = gtpo_token_advantages(entropy, mask, rewards, gid, groups, params, offset, responses)
    definition = gtpo_token_definition(entropy, mask, rewards, gid, groups, params, offset, responses)
    assert_same(kernel, definition)
    assert torch.count_nonzero(kernel[0] * (1 - mask)) == 0


def test_base_term_carries_alpha1_with_varying_offsets():
    """The default path (zero_fill, batch scopes) with alpha1 != 1 and bases that vary inside each polarity: the
    per-row base term a1 * (b_i - b0) enters the sums and the advantages with its a1 factor."""
    entropy, mask, rewards, gid, groups, _, offset = random_batch(11, groups=9, length=17)
    for alpha1 in (0.5, 2.0):
        params = GTPOParams(alpha1=alpha1, alpha2=0.3)
        adv, diag = gtpo_token_advantages(entropy, mask, rewards, gid, groups, params, offset)
        ref, ref_diag = gtpo_token_definition(entropy, mask, rewards, gid, groups, params, offset)
        torch.testing.assert_close(adv, ref, rtol=1e-5, atol=1e-6)
        assert diag["shaped_correct_mean"] == pytest.approx(ref_diag["shaped_correct_mean"], rel=1e-9)
    # and the offsets matter: the same batch without them gives other advantages
    plain, _ = gtpo_token_advantages(entropy, mask, rewards, gid, groups, GTPOParams(alpha1=0.5, alpha2=0.3))
    assert (plain - adv).abs().max() > 1e-2


@pytest.mark.parametrize(
    "mask_dtype, entropy_dtype",
    [(torch.bool, torch.float32), (torch.uint8, torch.float32), (torch.int32, torch.float32),
     (torch.int64, torch.float32), (torch.float64, torch.float32), (torch.bfloat16, torch.float32),
     (torch.float32, torch.float64), (torch.float32, torch.bfloat16)],
)  # fmt: skip
def test_every_mask_and_entropy_dtype(mask_dtype, entropy_dtype):
    """Each mask dtype as it is (bool read as uint8; half types converted), float32 / float64 entropy as it is."""
    entropy, mask, rewards, gid, groups, responses, offset = random_batch(5, holes=True)
    entropy = entropy.to(entropy_dtype)
    params = GTPOParams(conflict_mask=True, position="raw")  # the kernel's own reading of the holes
    kernel = gtpo_token_advantages(entropy, mask.to(mask_dtype), rewards, gid, groups, params, offset, responses)
    definition = gtpo_token_definition(entropy, mask, rewards, gid, groups, params, offset, responses)
    assert_same(kernel, definition)


@pytest.mark.parametrize("weight_scope, norm_scope", [("batch", "batch"), ("batch", "group"), ("group", "batch")])
def test_two_threads_equal_one(monkeypatch, weight_scope, norm_scope):
    """Rows (or groups) split over two threads give the one-thread result (up to the order of float64 sums)."""
    entropy, mask, rewards, gid, groups, responses, offset = random_batch(3, groups=60, length=40)
    params = GTPOParams(weight_scope=weight_scope, norm_scope=norm_scope, conflict_mask=True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = gtpo_token_advantages(entropy, mask, rewards, gid, groups, params, offset, responses)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert kernels.num_threads(len(rewards)) == 2
    two = gtpo_token_advantages(entropy, mask, rewards, gid, groups, params, offset, responses)
    assert_same(two, one)


def test_large_output_is_zero_on_padding():
    """A batch whose output takes the recycled mapping (> 8 MB), written over a freed output of the same size whose
    every element was non-zero: padding is written back to zeros."""
    gen = torch.Generator().manual_seed(0)
    rows, length = 1200, 2048
    lengths = torch.randint(0, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.int64)
    entropy = torch.where(mask.bool(), torch.rand(rows, length, generator=gen), float("nan"))
    rewards = torch.where(torch.rand(rows, generator=gen) < 0.4, 1.0, 0.0)
    gid = torch.arange(rows) % 75
    kernels._OUTPUTS.clear()
    full, _ = gtpo_token_advantages(torch.rand(rows, length, generator=gen) + 0.1, torch.ones(rows, length), rewards,
                                    gid, 75)  # fmt: skip
    assert torch.count_nonzero(full) == full.numel()
    address = full.data_ptr()
    del full
    adv, diag = gtpo_token_advantages(entropy, mask, rewards, gid, 75)
    assert adv.data_ptr() == address
    ref, ref_diag = gtpo_token_definition(entropy, mask, rewards, gid, 75)
    torch.testing.assert_close(adv, ref, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(adv[~mask.bool()]) == 0
    assert diag["frac_tokens_adv_pos"] == pytest.approx(ref_diag["frac_tokens_adv_pos"], abs=1e-6)


def test_joint_zero_variance_rule_uses_the_whole_set():
    """``joint``: the set holds both polarities, so its ``mean|x|`` runs over all its tokens. With ``zero_var_rtol``
    between std / mean|x| of the whole set and std / (sum of one polarity's |x| / n), the set is constant (advantage 0);
    a rule that summed one polarity only would keep the minority's advantages."""
    entropy, mask, _, gid, groups, _, _ = random_batch(4, groups=6, length=8)
    rewards = torch.where(torch.arange(len(gid)) % 9 == 0, 1.0, -1.0)  # correct tokens are a small minority
    params = GTPOParams(norm_mode="joint")
    shaped = gtpo_shaped_rewards(entropy, mask, rewards, gid, groups, params)[mask.bool()]
    correct_tok = (rewards > 0)[:, None].expand_as(mask)[mask.bool()]
    std, n = float(shaped.std()), shaped.numel()
    whole = std / (float(shaped.abs().sum()) / n)
    minority = std / (float(shaped[correct_tok].abs().sum()) / n)
    assert whole < 1 < minority or whole < minority < 1
    rtol = min((whole + min(minority, 1.0)) / 2, 0.999)
    assert whole < rtol < minority
    p = GTPOParams(norm_mode="joint", zero_var_rtol=rtol)
    adv, _ = gtpo_token_advantages(entropy, mask, rewards, gid, groups, p)
    ref, _ = gtpo_token_definition(entropy, mask, rewards, gid, groups, p)
    assert torch.count_nonzero(adv) == 0 and torch.count_nonzero(ref) == 0
    below, _ = gtpo_token_advantages(
        entropy, mask, rewards, gid, groups, GTPOParams(norm_mode="joint", zero_var_rtol=whole / 2)
    )
    assert torch.count_nonzero(below) > 0  # just below the whole set's ratio the set is not constant


def _fresh_kernel_state(monkeypatch):
    monkeypatch.setattr(kernel_dispatch, "_OFF", set())
    monkeypatch.setattr(kernels, "_WARNED", set(), raising=False)


class _NoNumba(importlib.abc.MetaPathFinder):
    """Finds every kernel module as a module whose ``import numba`` fails."""

    def find_spec(self, name, path=None, target=None):
        if name == "gtpo.algorithms.kernels":
            raise ModuleNotFoundError("No module named 'numba'", name="numba")
        return None


def test_falls_back_to_the_definition_when_numba_is_missing(monkeypatch):
    _fresh_kernel_state(monkeypatch)
    import gtpo.algorithms

    for name in [m for m in sys.modules if m == "gtpo.algorithms.kernels"]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh, through the finder below
        monkeypatch.delattr(gtpo.algorithms, name.rsplit(".", 1)[1], raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoNumba(), *sys.meta_path])
    entropy, mask, rewards, gid, groups, responses, offset = random_batch(0)
    with pytest.warns(RuntimeWarning, match="gtpo_token: compiled kernel unavailable.*numba"):
        adv, diag = gtpo_token_advantages(entropy, mask, rewards, gid, groups, None, offset)
    assert not kernel_dispatch.kernel_on("gtpo_token")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        again, _ = gtpo_token_advantages(entropy, mask, rewards, gid, groups, None, offset)
    ref, _ = gtpo_token_definition(entropy, mask, rewards, gid, groups, None, offset)
    assert torch.equal(adv, ref) and torch.equal(again, ref)
    assert "kernel_compile_s" not in diag
    bad = entropy.clone()
    bad[tuple(mask.bool().nonzero()[3].tolist())] = float("nan")
    with pytest.raises(ValueError, match="NaN on 1 valid token"):  # the definition path checks the values too
        gtpo_token_advantages(bad, mask, rewards, gid, groups)


def test_falls_back_to_the_definition_when_the_kernel_fails_to_compile(monkeypatch):
    _fresh_kernel_state(monkeypatch)
    from numba.core.errors import NumbaError

    def broken(*args, **kwargs):
        raise NumbaError("no LLVM target")

    monkeypatch.setattr(kernels, "gtpo_token_kernel", broken)
    entropy, mask, rewards, gid, groups, _, offset = random_batch(1)
    with pytest.warns(RuntimeWarning, match="gtpo_token: compiled kernel failed"):
        adv, _ = gtpo_token_advantages(entropy, mask, rewards, gid, groups, None, offset)
    ref, _ = gtpo_token_definition(entropy, mask, rewards, gid, groups, None, offset)
    assert torch.equal(adv, ref)
    assert not kernel_dispatch.kernel_on("gtpo_token")  # off for the rest of the process
    assert kernel_dispatch.kernel_on("grpo_s")


def test_an_error_of_the_kernel_other_than_numba_s_is_raised(monkeypatch):
    """Only numba's own errors switch a kernel off: a bug in the kernel's Python side is not hidden."""
    _fresh_kernel_state(monkeypatch)

    def buggy(*args, **kwargs):
        raise IndexError("index 7 is out of bounds")

    monkeypatch.setattr(kernels, "gtpo_token_kernel", buggy)
    entropy, mask, rewards, gid, groups, _, offset = random_batch(1)
    with pytest.raises(IndexError, match="out of bounds"):
        gtpo_token_advantages(entropy, mask, rewards, gid, groups, None, offset)
    assert kernel_dispatch.kernel_on("gtpo_token")


def test_bad_values_raise_the_definitions_messages():
    entropy, mask, rewards, gid, groups, _, _ = random_batch(6, holes=True)
    valid = mask.bool().nonzero()
    for value, match in ((float("nan"), "NaN on 1 valid token"), (float("inf"), "inf on 1 valid token"),
                         (-0.5, "negative value -0.5")):  # fmt: skip
        bad = entropy.clone()
        bad[tuple(valid[2].tolist())] = value
        with pytest.raises(ValueError, match=match):
            gtpo_token_advantages(bad, mask, rewards, gid, groups)
    with pytest.raises(ValueError, match="only 0 and 1"):
        gtpo_token_advantages(entropy, mask * 2, rewards, gid, groups)


def _valid_token(mask, rewards, correct: bool, dense: bool):
    """(row, column) of a valid token in the middle of a row of the given polarity, dense or with holes."""
    for row in range(mask.shape[0]):
        m = mask[row].bool()
        n, last = int(m.sum()), int(m.nonzero().max()) if m.any() else -1
        if (rewards[row] > 0) == correct and n >= 3 and (n == last + 1) == dense:
            return row, int(m.nonzero()[n // 2])
    raise AssertionError("no such row")  # pragma: no cover


@pytest.mark.parametrize("weight_scope, norm_scope", [("batch", "batch"), ("group", "group"), ("group", "batch")])
@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("correct", [True, False])
def test_a_half_on_a_valid_token_is_refused(weight_scope, norm_scope, dense, correct):
    """A float mask holding 0.5 where it is 1 is refused as the definition refuses it (not read as valid)."""
    entropy, mask, rewards, gid, groups, _, _ = random_batch(4, groups=12, holes=not dense)
    row, col = _valid_token(mask, rewards, correct, dense)
    bad = mask.clone()
    bad[row, col] = 0.5
    params = GTPOParams(weight_scope=weight_scope, norm_scope=norm_scope)
    with pytest.raises(ValueError, match="only 0 and 1"):
        gtpo_token_advantages(entropy, bad, rewards, gid, groups, params)


@pytest.mark.parametrize("weight_scope, norm_scope", [("batch", "batch"), ("group", "group"), ("group", "batch")])
@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("correct", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_slightly_negative_entropy_is_clamped(monkeypatch, weight_scope, norm_scope, dense, correct, threads):
    """An entropy in [-neg_entropy_tol, 0) is 0 in the weights (Eq. 3 / Eq. 5), as in the definition: on an
    incorrect token an unclamped value would give a 1/H weight that is huge and of either sign."""
    entropy, mask, rewards, gid, groups, _, _ = random_batch(4, groups=40, holes=not dense)
    row, col = _valid_token(mask, rewards, correct, dense)
    for value in (-0.05, -1e-7):
        bad = entropy.clone()
        bad[row, col] = value
        params = GTPOParams(weight_scope=weight_scope, norm_scope=norm_scope, position="raw")
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        kernel = gtpo_token_advantages(bad, mask, rewards, gid, groups, params)
        zero = entropy.clone()
        zero[row, col] = 0.0
        assert_same(kernel, gtpo_token_definition(bad, mask, rewards, gid, groups, params))
        # the same advantages as an exact 0 (only the raw entropy means differ)
        torch.testing.assert_close(kernel[0], gtpo_token_advantages(zero, mask, rewards, gid, groups, params)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_take_the_definition():
    entropy, mask, rewards, gid, groups, responses, offset = random_batch(2)
    cuda = [t.cuda() for t in (entropy, mask, rewards, gid, responses, offset)]
    adv, _ = gtpo_token_advantages(*cuda[:4], groups, GTPOParams(conflict_mask=True), cuda[5], cuda[4])
    assert adv.device.type == "cuda"
    ref, _ = gtpo_token_advantages(entropy, mask, rewards, gid, groups, GTPOParams(conflict_mask=True), offset,
                                   responses)  # fmt: skip
    torch.testing.assert_close(adv.cpu(), ref, rtol=1e-5, atol=1e-6)


COMPILE_PROBE = """
import json, torch
from gtpo.algorithms.gtpo_token import gtpo_token_advantages
e = torch.rand(6, 5); m = torch.ones(6, 5); r = torch.tensor([1., -1., 1., -1., 1., 1.]); g = torch.arange(6) % 2
first = gtpo_token_advantages(e, m, r, g, 2)[1]
second = gtpo_token_advantages(e, m, r, g, 2)[1]
print(json.dumps([first.get("kernel_compile_s"), second.get("kernel_compile_s")]))
"""


def test_compile_time_is_reported_on_the_first_call_only():
    """A fresh process pays the compile (or the load from numba's disk cache) once, and says so in its diagnostics."""
    res = subprocess.run([sys.executable, "-c", COMPILE_PROBE], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    first, second = json.loads(res.stdout.strip().splitlines()[-1])
    assert first is not None and first > 0 and second is None


def test_registering_the_plugin_imports_no_kernel():
    """verl imports the plugin in every Ray process; only the one that computes advantages loads (and compiles) a
    kernel, on its first call."""
    probe = (
        "import sys, gtpo.verl_plugin.register; "
        "print([m for m in sys.modules if m == 'numba' or m.startswith('gtpo.') and m.endswith(('kernel', 'passes'))])"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]"
