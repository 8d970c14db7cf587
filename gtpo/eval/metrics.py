"""Evaluation metrics over n sampled answers per problem (pure numpy; no verl, no grading).

* ``pass@k`` — unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
  arXiv 2107.03374, Eq. 1): with n samples of which c are correct, ``1 - C(n-c, k) / C(n, k)``, computed in the
  numerically stable product form ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (exactly 1 when ``n - c < k``).
  Averaged over problems; defined only for ``k <= n``.
* ``avg@n`` (mean@n) — mean correctness over all n samples of a problem, averaged over problems (= pass@1).
* ``maj@k`` — majority vote over the extracted answers of the FIRST k samples of each problem (in sample order),
  not the average over all k-subsets: deterministic and cheap, and for k = n both coincide. Votes go by the
  normalised answer string (``gtpo.reward.extract.normalize_for_vote`` upstream); empty answers ("no answer")
  do not vote. Tie rule: among the most-voted answers, the one whose first vote came earliest wins. The vote is
  correct if the first sample carrying the winning answer was graded correct; a problem with no answer at all
  counts as wrong.

* ``Mean@n`` / ``Pass@k`` — paper A's Table 1 names (arXiv 2508.04349, Sec. 3.1: "Pass@k ... Mean@32 is also
  reported"): Mean@32 is avg@n at n = 32, Pass@k the unbiased pass@k above. The paper does not say how it estimated
  Pass@k; most of its Pass@32 cells are not multiples of 1/30, so they are not one 32-sample run of AIME's 30
  problems (docs/ALGORITHMS.md §10.2).

verl's in-loop ``best@k`` is a with-replacement bootstrap (biased low, verl issue #7240); ``validation_pass_at_k``
and ``validation_table1`` give the unbiased values from the same per-sample arrays verl's ``_val_metrics_update``
receives.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_KS",
    "TABLE1_BENCHMARKS",
    "TABLE1_KS",
    "avg_at_n",
    "group_samples",
    "maj_at_k",
    "majority_vote",
    "pass_at_k",
    "pass_at_k_mean",
    "summarize_groups",
    "table1_columns",
    "validation_pass_at_k",
    "validation_table1",
]

DEFAULT_KS = (1, 2, 4, 8, 16, 32)

# Paper A (arXiv 2508.04349) Table 1: Mean@32, Pass@4 and Pass@32 on AIME 2024 / 2025, Mean@32 on MATH 500.
TABLE1_KS = (4, 32)
TABLE1_BENCHMARKS = (
    ("aime2024", "AIME24", ("Mean", "Pass@4", "Pass@32")),
    ("aime2025", "AIME25", ("Mean", "Pass@4", "Pass@32")),
    ("math500", "MATH500", ("Mean",)),
)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased probability that at least one of k samples (drawn without replacement from n) is correct."""
    if not (0 <= c <= n):
        raise ValueError(f"c={c}: must satisfy 0 <= c <= n={n}")
    if not (1 <= k <= n):
        raise ValueError(f"k={k}: must satisfy 1 <= k <= n={n}")
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def pass_at_k_mean(ns: Sequence[int], cs: Sequence[int], k: int) -> float:
    """Mean pass@k over problems with ``ns[j]`` samples and ``cs[j]`` correct ones (every ``ns[j] >= k``)."""
    if len(ns) != len(cs):
        raise ValueError(f"len(ns)={len(ns)} != len(cs)={len(cs)}")
    if len(ns) == 0:
        raise ValueError("no problems")
    return float(np.mean([pass_at_k(int(n), int(c), k) for n, c in zip(ns, cs, strict=True)]))


def avg_at_n(accs_per_problem: Sequence[Sequence[bool]]) -> float:
    """Mean over problems of the per-problem fraction of correct samples."""
    return float(np.mean([np.mean(np.asarray(a, dtype=np.float64)) for a in accs_per_problem]))


def majority_vote(preds: Sequence[str], accs: Sequence[bool]) -> tuple[str, bool]:
    """(winning answer, its correctness) for one problem; ("", False) if no sample has an answer."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, p in enumerate(preds):
        if not p:
            continue
        counts[p] = counts.get(p, 0) + 1
        first.setdefault(p, i)
    if not counts:
        return "", False
    # most votes, then earliest first vote
    winner = min(counts, key=lambda p: (-counts[p], first[p]))
    return winner, bool(accs[first[winner]])


def maj_at_k(preds_per_problem: Sequence[Sequence[str]], accs_per_problem: Sequence[Sequence[bool]], k: int) -> float:
    """Mean over problems of the majority vote's correctness among the first k samples."""
    if k < 1:
        raise ValueError(f"k={k}: must be >= 1")
    vals = []
    for preds, accs in zip(preds_per_problem, accs_per_problem, strict=True):
        if len(preds) < k:
            raise ValueError(f"k={k} exceeds a problem's sample count {len(preds)}")
        vals.append(majority_vote(list(preds)[:k], list(accs)[:k])[1])
    return float(np.mean(vals))


def group_samples(keys: Sequence[Any], values: Sequence[Any]) -> dict[Any, list[Any]]:
    """Values grouped by key, in first-seen key order and sample order."""
    out: dict[Any, list[Any]] = defaultdict(list)
    for key, val in zip(keys, values, strict=True):
        out[key].append(val)
    return dict(out)


def summarize_groups(
    accs_per_problem: Sequence[Sequence[bool]],
    preds_per_problem: Sequence[Sequence[str]] | None = None,
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, float]:
    """Metrics for one benchmark: ``n_problems``, ``n_min``/``n_max`` samples, ``avg@n``, ``pass@k`` and
    ``maj@k`` for every k in ``ks`` with k <= the smallest per-problem sample count n_min (``maj@n_min`` too)."""
    if not accs_per_problem:
        raise ValueError("no problems")
    ns = [len(a) for a in accs_per_problem]
    if min(ns) < 1:
        raise ValueError("a problem has no samples")
    cs = [int(np.sum(np.asarray(a, dtype=bool))) for a in accs_per_problem]
    n_min = min(ns)
    out: dict[str, float] = {
        "n_problems": float(len(ns)),
        "n_min": float(n_min),
        "n_max": float(max(ns)),
        "avg@n": avg_at_n(accs_per_problem),
    }
    valid_ks = sorted({int(k) for k in ks if 1 <= int(k) <= n_min})
    for k in valid_ks:
        out[f"pass@{k}"] = pass_at_k_mean(ns, cs, k)
    if preds_per_problem is not None:
        for k in sorted(set(valid_ks) | {n_min}):
            out[f"maj@{k}"] = maj_at_k(preds_per_problem, accs_per_problem, k)
    return out


def _validation_groups(
    data_sources: Sequence[str],
    sample_uids: Sequence[str],
    accs: Sequence[Any],
    expected_counts: dict[tuple[str, str], int] | None = None,
) -> dict[str, list[list[bool]]]:
    """Per data source, one list of verdicts per prompt (see ``validation_pass_at_k`` for the arguments)."""
    if not (len(data_sources) == len(sample_uids) == len(accs)):
        raise ValueError(f"lengths differ: data_sources={len(data_sources)}, uids={len(sample_uids)}, accs={len(accs)}")
    per_group: dict[tuple[str, str], list[bool]] = defaultdict(list)
    for ds, uid, a in zip(data_sources, sample_uids, accs, strict=True):
        key = (str(ds), str(uid))
        if a is None:
            per_group.setdefault(key, [])
            continue
        per_group[key].append(bool(float(a) > 0))
    if expected_counts:
        for (ds, uid), n in expected_counts.items():
            got = per_group.setdefault((str(ds), str(uid)), [])
            got.extend([False] * max(int(n) - len(got), 0))
    by_source: dict[str, list[list[bool]]] = defaultdict(list)
    for (ds, _), vals in per_group.items():
        if vals:
            by_source[ds].append(vals)
    return dict(by_source)


def validation_pass_at_k(
    data_sources: Sequence[str],
    sample_uids: Sequence[str],
    accs: Sequence[Any],
    ks: Sequence[int] | None = None,
    expected_counts: dict[tuple[str, str], int] | None = None,
    section: str = "val-core",
    var_name: str = "acc",
) -> dict[str, float]:
    """Unbiased ``{section}/{data_source}/{var_name}/pass@k`` from per-sample validation arrays.

    Args:
        data_sources, sample_uids, accs: one entry per sample (verl's ``_val_metrics_update`` inputs:
            ``data_sources``, ``sample_uids`` and ``reward_extra_infos_dict["acc"]``). A sample is correct if its
            value is truthy and > 0 (bools, 0/1 and +-1 scores all work); ``None`` marks a failed session.
        ks: k values (default 1, 2, 4, ..., up to the largest n); only k <= the smallest per-prompt sample
            count of a data source are reported for it.
        expected_counts: verl's ``expected_acc_counts`` {(data_source, uid): n}; samples missing from the arrays
            (failed sessions) then count as incorrect, as verl's own acc metrics do.
    """
    metrics: dict[str, float] = {}
    for ds, groups in _validation_groups(data_sources, sample_uids, accs, expected_counts).items():
        ns = [len(g) for g in groups]
        cs = [sum(g) for g in groups]
        n_min = min(ns)
        if ks is None:
            use = [1 << i for i in range(n_min.bit_length()) if (1 << i) <= n_min]
            if n_min not in use:
                use.append(n_min)
        else:
            use = sorted({int(k) for k in ks if 1 <= int(k) <= n_min})
        for k in use:
            metrics[f"{section}/{ds}/{var_name}/pass@{k}"] = pass_at_k_mean(ns, cs, k)
    return metrics


def table1_columns(accs_per_problem: Sequence[Sequence[bool]], ks: Sequence[int] = TABLE1_KS) -> dict[str, float]:
    """Paper A's Table 1 columns for one benchmark: ``Mean@n`` (n = the largest per-problem sample count; the mean
    correctness over all samples, averaged over problems) and the unbiased ``Pass@k`` for each k <= the smallest
    per-problem sample count (Pass@4 and Pass@32 at n = 32)."""
    summary = summarize_groups(accs_per_problem, None, ks)
    out = {f"Mean@{int(summary['n_max'])}": summary["avg@n"]}
    out.update({f"Pass@{k}": summary[f"pass@{k}"] for k in ks if f"pass@{k}" in summary})
    return out


def validation_table1(
    data_sources: Sequence[str],
    sample_uids: Sequence[str],
    accs: Sequence[Any],
    expected_counts: dict[tuple[str, str], int] | None = None,
    section: str = "val-core",
    var_name: str = "acc",
) -> dict[str, float]:
    """``{section}/{data_source}/{var_name}/Mean@32`` (and ``Pass@4``, ``Pass@32``): ``table1_columns`` per data
    source from verl's per-sample validation arrays (arguments as ``validation_pass_at_k``)."""
    return {
        f"{section}/{ds}/{var_name}/{name}": value
        for ds, groups in _validation_groups(data_sources, sample_uids, accs, expected_counts).items()
        for name, value in table1_columns(groups).items()
    }
