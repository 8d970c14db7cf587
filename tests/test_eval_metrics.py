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
    table1_columns,
    validation_pass_at_k,
    validation_table1,
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


def test_maj_at_k_first_k_differs_from_last_k():
    """The first k samples vote, not the last k (nor all n): here the two majorities have opposite verdicts."""
    preds = [["x", "x", "y", "y", "y"], ["p", "q", "q", "p", "p"]]
    accs = [[True, True, False, False, False], [False, True, True, False, False]]
    # first 2: "x" (right) and a p/q tie -> "p" (wrong); the last 2 would give "y" (wrong) and "p" (wrong)
    assert maj_at_k(preds, accs, 2) == 0.5
    # first 3: "x" (right) and "q" (right); the last 3 would give "y" and "p", both wrong
    assert maj_at_k(preds, accs, 3) == 1.0
    # all 5: "y" (wrong) and "p" (wrong)
    assert maj_at_k(preds, accs, 5) == 0.0


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


def test_table1_columns_by_hand():
    """Paper A's Table 1 columns: Mean@n over all samples, unbiased Pass@4 / Pass@32 only where n allows."""
    # 32 samples each: 8 correct, 0 correct, 32 correct
    groups = [[True] * 8 + [False] * 24, [False] * 32, [True] * 32]
    out = table1_columns(groups)
    assert set(out) == {"Mean@32", "Pass@4", "Pass@32"}
    assert out["Mean@32"] == pytest.approx((8 / 32 + 0 + 1) / 3)
    pass4 = 1 - math.comb(24, 4) / math.comb(32, 4)
    assert out["Pass@4"] == pytest.approx((pass4 + 0 + 1) / 3)
    assert out["Pass@32"] == pytest.approx(2 / 3)
    # 4 samples per problem: Mean@4 and Pass@4, no Pass@32
    assert table1_columns([[True, False, False, False]]) == {"Mean@4": 0.25, "Pass@4": 1.0}


def test_validation_table1_names_and_failed_sessions():
    ds = ["aime2024"] * 8 + ["math500"] * 4
    uids = ["u1"] * 4 + ["u2"] * 4 + ["v1"] * 4
    accs = [1.0, -1.0, -1.0, -1.0] + [-1.0] * 4 + [1.0, 1.0, None, -1.0]
    m = validation_table1(ds, uids, accs, expected_counts={("math500", "v1"): 4})
    assert m == {
        "val-core/aime2024/acc/Mean@4": pytest.approx(0.125),
        "val-core/aime2024/acc/Pass@4": pytest.approx(0.5),
        # the failed session counts as incorrect: 2 of 4
        "val-core/math500/acc/Mean@4": pytest.approx(0.5),
        "val-core/math500/acc/Pass@4": pytest.approx(1.0),
    }
