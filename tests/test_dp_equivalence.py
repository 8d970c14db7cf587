"""One PPO actor update at data-parallel size 1 and 2 gives the same result, through verl 0.9.1's real code.

    .venv/bin/python -m pytest -q -n 0 tests/test_dp_equivalence.py

How (``tests/support/dp.py``): the driver steps of verl's ``PPOTrainer._step_once`` run on the recipe's trainer class
(padding and balancing for the dp size, the old-log-prob pass, the advantages, the actor's ``extra_info``), then
verl's ``ActorRolloutRefWorker.update_actor`` (FSDP2 engine, ``ppo_loss`` or the recipe's loss replacement) runs
once in 1 process and once in 2 processes over gloo, each rank on its chunk of verl's dispatch order. Same rollout
batch, same initial weights, one optimizer step: one mini-batch of 16 rows (15 responses to 4 prompts, one group a
response short, plus verl's padding row), micro-batches of 4 rows (4 on the single rank, 2 on each of two ranks).

Equal at dp = 1 and dp = 2 for ``gtpo`` (verl's vanilla loss, token-mean), ``grpo_s`` (the plugin's sequence loss,
seq-mean-token-mean), ``gtpo_traj`` (vanilla, seq-mean-token-mean) and ``dapo_forking`` with ``scope=batch``, to
fp32 rounding:

* ``actor/pg_loss`` as verl aggregates it over micro-batches and ranks, and ``actor/loss``: relative 1e-5 (the same
  fp32 sums in another order; observed at most 2e-7);
* ``actor/grad_norm``: relative 1e-5 (observed at most 7e-8);
* the updated weights: absolute 1e-6, 8 fp32 ulps at 1.0 (observed at most 1.2e-7, one ulp of a norm weight near 1),
  while the step moves every parameter tensor by at least 4e-5 and at most 1.2e-2 (largest element). The optimizer
  is SGD with no clipping in effect, so the weight change is ``lr`` times the gradient itself: a gradient off by a
  factor 2 (say, a per-rank instead of a global normaliser) moves the weights by up to 7e-3 more.

Different by design: forking ``scope=micro_batch`` takes the entropy quantile of each micro-batch, and verl balances
rows for the dp size, so the micro-batches hold different rows at dp = 1 and dp = 2. Checked instead: each
micro-batch selects its own top-rho tokens (``ceil(rho * n_valid)``, more only on entropy ties), and at both sizes
``pg_loss`` equals ``sum_mb (n_valid(mb) / N) * J(mb)``, ``J(mb)`` the clipped loss averaged over that selection,
recomputed here from each micro-batch's forward: the two runs differ exactly as their selections do.

Advantages are computed once, by the driver, over the whole batch: bitwise the same for any dp size and any arrival
order, zero on verl's padding rows, and equal to the estimator called directly on the real rows.

Runtime: 65-80 s on 2 cores shared with other work, about 75 s of CPU (three worker processes, each importing
verl); under pytest-xdist the workers share one computation of the runs.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from gtpo.methods import METHODS as ROWS
from tests.support import dp as S

EQUIVALENT = ("gtpo", "grpo_s", "gtpo_traj", "forking_batch")
RECIPE_ESTIMATORS = tuple(name for name, row in ROWS.items() if row.advantages is not None)
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-6


@pytest.fixture(scope="module")
def models():
    import gtpo.verl_plugin.register  # noqa: F401

    return S.build_models()


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory, worker_id):
    """Every method's driver batch at dp = 1 and 2, the worker results (``results[method, dp][rank]``) and the
    initial weights. Computed once per session: pytest-xdist workers share it through the session's base folder."""
    if worker_id == "master":
        batches, results = _run_both(models, tmp_path_factory.mktemp("dp"))
    else:
        from filelock import FileLock

        shared = tmp_path_factory.getbasetemp().parent / "dp_equivalence"
        with FileLock(f"{shared}.lock"):
            if not (shared / "runs.pt").exists():
                shared.mkdir()
                torch.save(_run_both(models, shared), shared / "runs.pt")
            batches, results = torch.load(shared / "runs.pt", weights_only=False)
    initial = {name: p.detach().clone() for name, p in models[1].named_parameters()}
    return batches, results, initial


def _run_both(models, folder):
    old, trained = models
    S.write_model_dir(folder / "model", trained)
    batches, jobs = {}, {1: [], 2: []}
    for method in S.METHODS:
        cfg = S.compose_config(method, folder / "model")
        for dp in (1, 2):
            batch = S.driver_batch(cfg, dp, old)
            batches[method, dp] = batch
            jobs[dp].append(S.Job(method, [batch.rank_rows(r) for r in range(dp)], batch.nested, batch.extra_info))
    groups = {dp: S.start_ranks(dp, jobs[dp], folder) for dp in (1, 2)}
    by_dp = S.wait_ranks(groups, folder, timeout=600)
    return batches, {(m, dp): [rank[m] for rank in by_dp[dp]] for m in S.METHODS for dp in (1, 2)}


def _padded(rows: list[dict], name: str, width: int) -> torch.Tensor:
    return torch.stack([torch.nn.functional.pad(r[name], (0, width - len(r[name]))) for r in rows])


# ----------------------------------------------------------------------------------------------------------------
# driver: the estimator sees the whole batch


@pytest.mark.parametrize("method", RECIPE_ESTIMATORS)
def test_advantages_do_not_depend_on_dp_size_row_order_or_padding(models, method):
    """The recipe's ``_compute_advantage`` after verl's ``_balance_batch`` for dp = 1, 2, 4 and two arrival orders
    gives every response bitwise the advantages of the estimator called directly on the 15 real rows in rollout
    order; verl's padding row gets zeros."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    old, _ = models
    cfg = S.compose_config(method, "unused")
    shuffled = list(range(15))
    random.Random(0).shuffle(shuffled)
    batches = [S.driver_batch(cfg, dp, old, order=order) for dp in (1, 2, 4) for order in (None, shuffled)]

    # the direct call: the rollout rows, in rollout order, no padding, old-policy entropy from the same pass
    keys, _, _ = S.rollout_rows(S.build_tokenizer())
    rows = [batches[0].rows[k] for k in keys]
    expected, _ = get_adv_estimator_fn(method)(
        token_level_rewards=_padded(rows, "rm_scores", S.MAX_RESPONSE),
        response_mask=_padded(rows, "response_mask", S.MAX_RESPONSE),
        index=np.array([r["uid"] for r in rows], dtype=object),
        config=cfg.algorithm,
        entropy=_padded(rows, "entropy", S.MAX_RESPONSE),
        responses=_padded(rows, "responses", S.MAX_RESPONSE),
        metrics={},
    )
    assert expected.abs().sum() > 0

    orders = {tuple(b.keys) for b in batches}
    assert len(orders) >= 4, "the balanced dispatch orders should differ between dp sizes and arrival orders"
    for batch in batches:
        padding = [k for k, t in zip(batch.keys, batch.tags, strict=True) if t.get("is_padding", False)]
        assert len(padding) == 1 and len(batch.keys) == 16
        assert not batch.rows[padding[0]]["advantages"].any()
        assert batch.metrics[f"{method}/estimator_rows"] == 15.0
        for i, key in enumerate(keys):
            got = batch.rows[key]["advantages"]
            assert torch.equal(got, expected[i, : len(got)]), (method, batch.dp, key)


def test_forking_batch_threshold_does_not_depend_on_dp_size_or_order(models):
    """``scope=batch``: the driver's whole-batch threshold and selected fraction reach the workers unchanged at any
    dp size and arrival order, and the fraction is the top-rho share of the 139 valid tokens."""
    from gtpo.algorithms import token_selection as forking

    old, _ = models
    cfg = S.compose_config("forking_batch", "unused")
    shuffled = list(range(15))
    random.Random(1).shuffle(shuffled)
    infos = [S.driver_batch(cfg, dp, old, order=o).extra_info for dp in (1, 2, 4) for o in (None, shuffled)]
    thresholds = {info[forking.THRESHOLD_KEY] for info in infos}
    fractions = {info[forking.FRACTION_KEY] for info in infos}
    assert len(thresholds) == 1 and len(fractions) == 1
    n_valid = sum(sum(lens) for _, lens, _ in S.GROUPS)
    assert n_valid == 139
    assert fractions.pop() * n_valid >= math.ceil(S.RHO * n_valid)


# ----------------------------------------------------------------------------------------------------------------
# workers: one update at dp = 1 and dp = 2


def test_each_rank_trains_its_chunk_with_the_global_token_count(runs):
    """The harness does what verl's dispatch does: rank r gets chunk r of the dispatch order, cut into micro-batches
    of 4 rows in order; every micro-batch's loss sees the all-reduced token count of the whole mini-batch."""
    batches, results, _ = runs
    for method in S.METHODS:
        for dp in (1, 2):
            batch = batches[method, dp]
            n_tokens = sum(int(batch.rows[k]["response_mask"].sum()) for k in batch.keys)
            for rank in range(dp):
                chunk = batch.rank_keys(rank)
                expected = [chunk[i : i + S.MICRO_BATCH] for i in range(0, len(chunk), S.MICRO_BATCH)]
                records = results[method, dp][rank].micro_batches
                assert [r["rows"] for r in records] == expected, (method, dp, rank)
                assert all(r["batch_num_tokens"] == n_tokens == 139 for r in records)


@pytest.mark.parametrize("method", EQUIVALENT)
def test_update_is_the_same_at_dp_1_and_2(runs, method):
    batches, results, initial = runs
    one, two = results[method, 1][0], results[method, 2][0]
    for key in ("actor/pg_loss", "actor/loss", "actor/grad_norm"):
        assert two.metrics[key] == pytest.approx(one.metrics[key], rel=LOSS_RTOL, abs=1e-8), key
    assert one.metrics["actor/grad_norm"] > 0.1
    assert one.metrics["actor/lr"] == two.metrics["actor/lr"] == S.LR

    assert one.weights.keys() == two.weights.keys() == initial.keys()
    for name in initial:
        step = float((one.weights[name] - initial[name]).abs().max())
        assert step > 20 * WEIGHT_ATOL, f"{name}: the update must move every tensor far beyond the tolerance"
        torch.testing.assert_close(two.weights[name], one.weights[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_forking_micro_batch_scope_differs_as_its_micro_batches_do(runs, models):
    """``scope=micro_batch``: each micro-batch selects its own top-rho tokens of the training policy's entropy, and
    ``pg_loss = sum_mb (n_valid(mb) / N) * J(mb)`` at both dp sizes, with ``J(mb)`` verl's clipped loss averaged over
    that selection (:func:`tests.support.dp.forking_micro_batch_loss`). The micro-batches hold different rows at
    dp = 1 and dp = 2, so the losses differ, by what the formula predicts."""
    _, trained = models
    batches, results, _ = runs
    cfg = S.compose_config("forking_micro_batch", "unused")
    predicted, compositions = {}, {}
    for dp in (1, 2):
        records = [r for rank in results["forking_micro_batch", dp] for r in rank.micro_batches]
        predicted[dp] = S.forking_micro_batch_loss(cfg, batches["forking_micro_batch", dp], records, trained)
        compositions[dp] = {tuple(r["rows"]) for r in records if not any(k.startswith("pad") for k in r["rows"])}
        observed = results["forking_micro_batch", dp][0].metrics["actor/pg_loss"]
        assert observed == pytest.approx(predicted[dp], rel=LOSS_RTOL)

    assert compositions[1] != compositions[2]
    observed = results["forking_micro_batch", 1][0].metrics["actor/pg_loss"]
    observed -= results["forking_micro_batch", 2][0].metrics["actor/pg_loss"]
    assert abs(observed) > 100 * LOSS_RTOL * abs(predicted[1])
    assert observed == pytest.approx(predicted[1] - predicted[2], rel=1e-4)
