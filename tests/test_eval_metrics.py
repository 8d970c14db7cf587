"""pass@k / avg@n / maj@k: unbiased estimator against brute-force subset enumeration, vote tie rules, and the
in-loop validation helper against verl's (biased) bootstrap.

Run: cd /work/main && .venv/bin/pytest -q tests/test_eval_metrics.py
"""

from __future__ import annotations

import itertools
import math

import pytest

from gtpo.eval.metrics import (
    avg_at_n,
    maj_at_k,
    majority_vote,
    pass_at_k,
    pass_at_k_mean,
    summarize_groups,
    validation_pass_at_k,
)


def brute_pass_at_k(accs: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(accs)), k))
    return sum(any(accs[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_subset_enumeration(n):
    for c in range(n + 1):
        accs = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(accs, k), abs=1e-12)


def test_pass_at_k_large_n_matches_exact_binomials():
    for n, c, k in [(64, 1, 32), (64, 3, 16), (200, 7, 100), (1000, 2, 1)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    # no overflow / nan in the stable form for huge n
    assert 0.0 < pass_at_k(10_000, 1, 5_000) <= 1.0


def test_pass_at_k_edges_and_errors():
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 4) == 1.0  # verl's bootstrap best@4 reports ~0.68 here
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5"):
        pass_at_k(4, 5, 1)
    assert pass_at_k_mean([4, 4], [1, 0], 4) == 0.5


def test_avg_at_n_is_pass_at_1():
    groups = [[True, False, False, False], [True, True, False, True], [False] * 4]
    assert avg_at_n(groups) == pytest.approx((0.25 + 0.75 + 0) / 3)
    assert avg_at_n(groups) == pytest.approx(pass_at_k_mean([4, 4, 4], [1, 3, 0], 1))


def test_majority_vote_tie_rule_and_empty_answers():
    # 2 vs 2 tie: "7" was voted first, so it wins even though "3" is correct
    assert majority_vote(["7", "3", "3", "7"], [False, True, True, False]) == ("7", False)
    assert majority_vote(["3", "7", "7", "3"], [True, False, False, True]) == ("3", True)
    # empty answers do not vote, even when they are the most frequent
    assert majority_vote(["", "", "", "5"], [False, False, False, True]) == ("5", True)
    assert majority_vote(["", ""], [False, False]) == ("", False)
    # a clear majority wins regardless of order
    assert majority_vote(["1", "2", "2", "2", "1"], [True, False, False, False, True]) == ("2", False)


def test_maj_at_k_uses_first_k_samples():
    preds = [["a", "b", "b", "b"], ["c", "c", "d", "d"]]
    accs = [[True, False, False, False], [False, False, True, True]]
    assert maj_at_k(preds, accs, 1) == 0.5  # "a" right, "c" wrong
    assert maj_at_k(preds, accs, 2) == 0.5  # tie a/b -> a (first); "c"
    assert maj_at_k(preds, accs, 4) == 0.0  # "b"; tie c/d -> c
    with pytest.raises(ValueError, match="k=5"):
        maj_at_k(preds, accs, 5)


def test_summarize_groups_only_reports_k_up_to_n_min():
    accs = [[True, False, False, False, False, False], [False, False, False, True]]
    preds = [["1", "2", "2", "2", "2", "2"], ["", "9", "9", "4"]]
    out = summarize_groups(accs, preds, ks=(1, 2, 4, 8))
    assert out["n_problems"] == 2 and out["n_min"] == 4 and out["n_max"] == 6
    assert "pass@8" not in out and "maj@8" not in out
    assert out["pass@4"] == pytest.approx((pass_at_k(6, 1, 4) + pass_at_k(4, 1, 4)) / 2)
    assert out["maj@4"] == 0.0
    assert out["maj@1"] == 0.5  # "1" right; "" (no answer) wrong
    assert out["avg@n"] == pytest.approx((1 / 6 + 1 / 4) / 2)


def test_validation_pass_at_k_keys_values_and_failed_sessions():
    ds = ["aime"] * 8 + ["math"] * 4
    uids = ["u1"] * 4 + ["u2"] * 4 + ["v1"] * 2 + ["v2"] * 2
    accs = [True, False, False, False] + [False] * 4 + [1.0, -1.0] + [-1.0, None]
    m = validation_pass_at_k(ds, uids, accs, expected_counts={("math", "v2"): 2, ("math", "v1"): 2})
    assert set(m) == {
        "val-core/aime/acc/pass@1",
        "val-core/aime/acc/pass@2",
        "val-core/aime/acc/pass@4",
        "val-core/math/acc/pass@1",
        "val-core/math/acc/pass@2",
    }
    assert m["val-core/aime/acc/pass@4"] == 0.5
    assert m["val-core/aime/acc/pass@1"] == pytest.approx(0.125)
    # v2 lost a session: counted as incorrect (n=2, c=0); v1 has c=1 of 2
    assert m["val-core/math/acc/pass@2"] == pytest.approx(0.5)
    assert validation_pass_at_k(ds, uids, accs, ks=(4, 64), section="val-aux") == {"val-aux/aime/acc/pass@4": 0.5}
    with pytest.raises(ValueError, match="lengths differ"):
        validation_pass_at_k(ds, uids[:-1], accs)


def test_verl_bootstrap_best_at_k_is_biased_low_and_ours_is_not():
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    ds, uids, accs = ["d"] * 4, ["u"] * 4, [1.0, 0.0, 0.0, 0.0]
    verl_best = process_validation_metrics(ds, uids, {"acc": accs})["d"]["acc"]["best@4/mean"]
    assert verl_best < 0.8
    assert validation_pass_at_k(ds, uids, accs)["val-core/d/acc/pass@4"] == 1.0
