"""GROP length penalty (arXiv 2508.04349 v6, App. D; docs/ALGORITHMS.md §5): cases, knee, penalty shape, loop reference.

Run: cd /work/main && .venv/bin/pytest -q tests/test_grop.py
"""

from __future__ import annotations

import random

import pytest
import torch

from gtpo.algorithms.length_penalty import GROPParams, grop_knee_and_target, grop_penalty


def _one_group(lengths, correct, gamma1=0.75, **knobs):
    n = len(lengths)
    return grop_penalty(
        torch.tensor(lengths, dtype=torch.float32),
        torch.tensor(correct),
        torch.zeros(n, dtype=torch.long),
        1,
        params=GROPParams(gamma1=gamma1, **knobs),
    )


def _reference(lengths, correct, labels, gamma1, medium_penalise_incorrect=False):
    """Per-group Python transcription of App. D (docs/ALGORITHMS.md §5 pseudo-code)."""
    out = [0.0] * len(lengths)
    for g in set(labels):
        rows = [i for i in range(len(lengths)) if labels[i] == g]
        ell = [float(lengths[i]) for i in rows]
        c = [bool(correct[i]) for i in rows]
        G = len(rows)
        n = sum(c)
        m = G - n
        frac = n / G

        def knee(x):
            return max((min(x) + max(x)) / 2, sum(x) / len(x), 1.0)

        if frac >= gamma1 - 1e-9:
            L = knee([e for e, ci in zip(ell, c) if ci])
            target = c
        elif frac <= 1 - gamma1 + 1e-9:
            continue
        else:
            L = knee(ell)
            if n > m:
                target = c
            elif medium_penalise_incorrect:
                target = [not ci for ci in c]
            else:
                continue
        for k, i in enumerate(rows):
            if not target[k]:
                continue
            e = ell[k]
            out[i] = 0.0 if e < L else (-0.5 * (e - L) / L if e < 2 * L else -0.5)
    return torch.tensor(out, dtype=torch.float64)


def test_easy_group_penalises_long_correct_with_knee_over_correct():
    # 3 of 4 correct (frac 0.75 >= 0.75): knee over correct lengths [10, 20, 30] = max(20, 20, 1) = 20
    pen = _one_group([10, 20, 30, 100], [True, True, True, False])
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.25, 0.0], dtype=torch.float64))


def test_easy_group_ramp():
    # all correct, knee over [4, 4, 4, 40] = max(22, 13) = 22: 40 is in [L, 2L) -> -0.5 * 18 / 22
    pen = _one_group([4, 4, 4, 40], [True] * 4)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, 0.0, -0.5 * 18 / 22], dtype=torch.float64))


def test_hard_group_no_penalty():
    pen = _one_group([10, 500, 800, 900], [True, False, False, False])  # frac 0.25 <= 0.25
    assert torch.count_nonzero(pen) == 0


def test_medium_group_more_correct_penalises_correct():
    # 2 of 3 correct (frac 0.667, medium), n > m: knee over all lengths [10, 30, 50] = max(30, 30) = 30
    pen = _one_group([10, 50, 30], [True, True, False])
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.5 * 20 / 30, 0.0], dtype=torch.float64))


def test_medium_group_not_more_correct_penalises_incorrect_only_as_option():
    # 2 of 4 correct (n == m): the paper punishes nothing (App. D: "if n > m" only)
    lengths, correct = [10, 20, 30, 60], [False, True, True, False]
    assert torch.count_nonzero(_one_group(lengths, correct)) == 0
    # the option penalises the incorrect ones; knee over [10, 20, 30, 60] = max(35, 30) = 35
    pen = _one_group(lengths, correct, medium_penalise_incorrect=True)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, 0.0, -0.5 * 25 / 35], dtype=torch.float64))
    # the same group with n > m penalises its long correct response under either setting
    for option in (False, True):
        pen = _one_group([10, 20, 60, 30], [False, True, True, True], medium_penalise_incorrect=option, gamma1=0.8)
        torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5 * 25 / 35, 0.0], dtype=torch.float64))


def test_hard_group_dapo_option():
    # 1 of 4 correct (hard): none by default; DAPO's soft punishment with L_max = 100, L_cache = 20 under "dapo"
    lengths, correct = [50, 85, 100, 130], [True, False, False, False]
    assert torch.count_nonzero(_one_group(lengths, correct)) == 0
    pen = _one_group(lengths, correct, hard_mode="dapo", dapo_max_length=100, dapo_buffer_length=20)
    torch.testing.assert_close(pen, torch.tensor([0.0, -5 / 20, -1.0, -1.0], dtype=torch.float64))
    # an easy group is untouched by the hard-group option
    easy = _one_group([10, 20, 30, 130], [True] * 4, hard_mode="dapo", dapo_max_length=100, dapo_buffer_length=20)
    torch.testing.assert_close(easy, _one_group([10, 20, 30, 130], [True] * 4))


def test_knee_at_least_one_and_boundaries():
    knee, target, case = grop_knee_and_target(
        torch.tensor([0.0, 0.0, 0.0, 0.0]), torch.tensor([True] * 4), torch.zeros(4, dtype=torch.long), 1
    )
    assert float(knee[0]) == 1.0 and int(case[0]) == 2 and bool(target.all())
    # l == L -> 0; l == 2L -> -0.5 exactly
    pen = _one_group([10, 10, 10, 20], [True] * 4)  # knee = max(15, 12.5) = 15 -> 20 in ramp
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, 0.0, -0.5 * 5 / 15], dtype=torch.float64))
    pen = _one_group([1, 3], [True, True])  # knee = max(2, 2) = 2: 1 -> 0, 3 -> -0.25
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.25], dtype=torch.float64))
    pen = _one_group([2, 2, 2, 8], [True] * 4)  # knee = max(5, 3.5) = 5: 8 -> -0.3
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, 0.0, -0.3], dtype=torch.float64))


def test_minus_half_branch():
    # l >= 2L needs l >= min + max over the knee set, i.e. a zero-length row: knee over [0, 0, 0, 40] = max(20, 10)
    pen = _one_group([0, 0, 0, 40], [True] * 4)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, 0.0, -0.5], dtype=torch.float64))
    pen = _one_group([1, 10], [True, True])  # knee 5.5: 10 < 11 -> ramp
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.5 * 4.5 / 5.5], dtype=torch.float64))


def test_gamma_changes_case():
    # 1 of 3 correct: hard under gamma1 = 0.6 (1/3 <= 0.4), medium under gamma1 = 0.75 (n < m: incorrect penalised)
    assert torch.count_nonzero(_one_group([100, 1, 1], [True, False, False], gamma1=0.6)) == 0
    pen = _one_group([100, 1, 80], [True, False, False], gamma1=0.75, medium_penalise_incorrect=True)  # medium
    knee = max((1 + 100) / 2, 181 / 3)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5 * (80 - knee) / knee], dtype=torch.float64))


@pytest.mark.parametrize("seed", range(8))
def test_vectorised_matches_loop_reference(seed):
    rng = random.Random(seed)
    lengths, correct, labels = [], [], []
    for k in range(8):
        for _ in range(rng.randint(1, 9)):
            lengths.append(rng.randint(0, 60))
            correct.append(rng.random() < rng.random())
            labels.append(k)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    lengths, correct, labels = ([x[i] for i in order] for x in (lengths, correct, labels))
    gamma1 = [0.75, 0.5, 0.6, 1.0][seed % 4]
    option = seed % 2 == 1
    p = GROPParams(gamma1=gamma1, medium_penalise_incorrect=option)
    pen = grop_penalty(
        torch.tensor(lengths), torch.tensor(correct), torch.tensor(labels, dtype=torch.long), 8, params=p
    )
    torch.testing.assert_close(pen, _reference(lengths, correct, labels, gamma1, option), atol=1e-12, rtol=0)
    assert bool((pen <= 0).all()) and bool((pen >= -0.5).all())


def test_gamma_half_frac_half_is_easy():
    # gamma1 = 0.5: frac 0.5 is both >= gamma1 and <= 1 - gamma1; easy wins (documented order)
    _, _, case = grop_knee_and_target(
        torch.tensor([5.0, 9.0]), torch.tensor([True, False]), torch.zeros(2, dtype=torch.long), 1, 0.5
    )
    assert int(case[0]) == 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"gamma1": 0.4}, "gamma1"),
        ({"gamma1": 1.5}, "gamma1"),
        ({"gamma1": "x"}, "gamma1"),
        ({"enable": 1}, "enable"),
        ({"medium_penalise_incorrect": 1}, "medium_penalise_incorrect"),
        ({"hard_mode": "soft"}, "hard_mode"),
        ({"dapo_max_length": 0}, "dapo_max_length"),
        ({"dapo_buffer_length": 4096, "dapo_max_length": 4096}, "dapo_buffer_length"),
    ],
)
def test_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        GROPParams(**kwargs)
    assert GROPParams() == GROPParams(enable=False, gamma1=0.75)


def test_bad_inputs():
    with pytest.raises(ValueError, match="lengths"):
        grop_penalty(torch.zeros(2, 2), torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="correct"):
        grop_penalty(torch.zeros(2), torch.ones(3, dtype=torch.bool), torch.zeros(2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="gid"):
        grop_penalty(torch.zeros(2), torch.ones(2, dtype=torch.bool), torch.tensor([0, 3]), 1)
    with pytest.raises(ValueError, match="lengths must be finite"):
        grop_penalty(torch.tensor([-1.0, 2.0]), torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long), 1)
