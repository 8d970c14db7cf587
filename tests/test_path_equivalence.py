"""The presets' code paths compute what the padded path computes: one PPO step through verl 0.9.1's own worker code.

    .venv/bin/python -m pytest -q -n 0 tests/test_path_equivalence.py

The model presets (and now the CPU backend) run verl's FSDP2 engine with remove padding, token-budget micro-batches,
chunked entropy and activation checkpointing; ``scale=dapo`` adds Ulysses, the 32B preset parameter and optimizer
offload. Each path of ``tests/support/paths.py`` runs the old-log-prob pass (verl's ``compute_log_prob`` on the old
policy: the per-token entropy the recipe's estimators read), the recipe's advantages on the whole batch, and one
actor update (verl's ``update_actor``, SGD, no clipping in effect) per method, on one fixed batch of 15 responses of
2-16 tokens to 4 prompts plus verl's 128-token padding row. The token budgets (128) pack 3-4 micro-batches of
different composition, reordered by length and restored; 7-token entropy chunks cut sequences.

Compared with the padded path with fixed micro-batches, on every path (worst difference seen over the 7 paths):

* old log-probs and entropy on every valid response token: absolute 1e-5 (fp32 sums in another order; seen 2.9e-6
  on log-probs of magnitude up to 11, 1.9e-6 on entropies of 0.04-2.5 nats);
* the advantages of ``grpo_s``, ``gtpo_traj`` and ``dapo_forking`` (verl's GRPO), and the forking threshold of
  ``scope=batch``: absolute 1e-6 (seen 6e-8, i.e. identical but for one ulp); ``gtpo``'s: absolute 1e-5, because
  its token rewards are H / sum H and (1/H) / sum (1/H) of those entropies, whitened (seen 2.5e-6 on advantages up to
  2.0);
* ``actor/pg_loss``, ``actor/loss``, ``actor/grad_norm``: relative 1e-5 (seen 1.1e-7, 2.9e-7); the updated weights:
  1e-6 absolute plus 1e-6 relative (seen 9.5e-7: one ulp of the final norm weight, 8.0), while the update moves every
  tensor by more than 20 times the absolute part.

Different by design: the forking loss with ``scope=micro_batch`` takes its top-rho tokens inside each micro-batch,
and token budgets change what a micro-batch holds, so its loss depends on how the budget packed the batch. Checked
instead: on every path it equals the per-micro-batch formula recomputed from that path's micro-batches
(``dp.forking_micro_batch_loss``), and the dynamic paths' loss differs from the padded one's. The method
preset therefore selects over the whole batch (``scope=batch``), which every path computes alike.

Planted faults must fail the comparison (each replaces one verl function in the rank process for the old-log-prob
pass only): two sequences' entropies swapped after the length reordering, a chunk boundary of the chunked entropy off
by one, the Ulysses shards gathered in reverse order.

Runtime: about 2 minutes of CPU in three spawned processes (world sizes 1 and 2 side by side); under pytest-xdist
the workers share one computation.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import dp as S
from tests.support import paths as P

OTHER_PATHS = [name for name in P.PATHS if name != "padded"]
EQUIVALENT = ("gtpo", "grpo_s", "gtpo_traj", "forking_batch")
OLD_ATOL = 1e-5
ADVANTAGE_ATOL = {"gtpo": 1e-5, "grpo_s": 1e-6, "gtpo_traj": 1e-6, "forking_batch": 1e-6}
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-6
WEIGHT_RTOL = 1e-6


@pytest.fixture(scope="module")
def trained():
    """The trained policy the harness updates (its weights before the step)."""
    return P.build_models()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory, worker_id):
    """``{(path, fault): PathResult}`` of every path and planted fault, computed once per session."""
    if worker_id == "master":
        return P.run_all(tmp_path_factory.mktemp("paths"))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "path_equivalence"
    with FileLock(f"{shared}.lock"):
        if not (shared / "results.pt").exists():
            shared.mkdir()
            torch.save(P.run_all(shared), shared / "results.pt")
        return torch.load(shared / "results.pt", weights_only=False)


def _real_keys(result: P.PathResult) -> list[str]:
    return sorted(k for k in result.old if not k.startswith("pad"))


def worst_old_difference(reference: P.PathResult, other: P.PathResult) -> tuple[float, float]:
    """Largest absolute difference of the old log-probs and of the entropy over every valid response token."""
    keys = _real_keys(reference)
    assert keys == _real_keys(other) and len(keys) == 15
    worst = [0.0, 0.0]
    for key in keys:
        for i in (0, 1):
            a, b = reference.old[key][i], other.old[key][i]
            assert a.shape == b.shape, key
            worst[i] = max(worst[i], float((a - b).abs().max()))
    return worst[0], worst[1]


def assert_same_old_pass(reference: P.PathResult, other: P.PathResult) -> None:
    log_probs, entropy = worst_old_difference(reference, other)
    assert log_probs <= OLD_ATOL, f"old log-probs differ by {log_probs:.3g}"
    assert entropy <= OLD_ATOL, f"entropy differs by {entropy:.3g}"


@pytest.mark.parametrize("path", OTHER_PATHS)
def test_old_log_probs_and_entropy_equal_the_padded_path(results, path):
    padded, other = results["padded", None], results[path, None]
    assert_same_old_pass(padded, other)
    # the entropies are not trivially equal: they vary over tokens
    spread = torch.cat([padded.old[k][1] for k in _real_keys(padded)])
    assert float(spread.max() - spread.min()) > 0.1


@pytest.mark.parametrize("method", EQUIVALENT)
@pytest.mark.parametrize("path", OTHER_PATHS)
def test_advantages_equal_the_padded_path(results, path, method):
    from gtpo.verl_plugin import actor_loss

    padded, other = results["padded", None], results[path, None]
    for key in _real_keys(padded):
        torch.testing.assert_close(
            other.advantages[method][key], padded.advantages[method][key], rtol=0, atol=ADVANTAGE_ATOL[method], msg=key
        )
    assert any(padded.advantages[method][k].abs().sum() > 0 for k in _real_keys(padded))
    if method == "forking_batch":
        for name in (actor_loss.THRESHOLD_KEY, actor_loss.FRACTION_KEY):
            reference = padded.batches[method].extra_info[name]
            assert other.batches[method].extra_info[name] == pytest.approx(reference, rel=0, abs=1e-6)


@pytest.mark.parametrize("method", EQUIVALENT)
@pytest.mark.parametrize("path", OTHER_PATHS)
def test_update_equals_the_padded_path(results, trained, path, method):
    one, other = results["padded", None].updates[method], results[path, None].updates[method]
    for key in ("actor/pg_loss", "actor/loss", "actor/grad_norm"):
        assert other.metrics[key] == pytest.approx(one.metrics[key], rel=LOSS_RTOL, abs=1e-8), key
    assert one.metrics["actor/grad_norm"] > 0.1
    initial = {name: p.detach() for name, p in trained.named_parameters()}
    assert one.weights.keys() == other.weights.keys() == initial.keys()
    for name in initial:
        step = float((one.weights[name] - initial[name]).abs().max())
        assert step > 20 * WEIGHT_ATOL, f"{name}: the update must move every tensor far beyond the tolerance"
        torch.testing.assert_close(other.weights[name], one.weights[name], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=name)


def test_token_budgets_pack_several_micro_batches_of_different_composition(results):
    """The dynamic paths really reorder and pack: several micro-batches per pass, of varying row counts, none equal
    to a fixed 4-row micro-batch of the padded path; the Ulysses path trains on every row on both ranks."""
    padded = [tuple(r["rows"]) for r in results["padded", None].updates["gtpo"].micro_batches]
    assert all(len(rows) == S.MICRO_BATCH for rows in padded) and len(padded) == 4
    for path in ("dynamic_bsz", "checkpointing", "offload", "ulysses2"):
        packed = [tuple(r["rows"]) for r in results[path, None].updates["gtpo"].micro_batches]
        # verl scales the training budget by the Ulysses size (two ranks share each sequence)
        assert len(packed) >= (3 if P.PATHS[path].sp == 1 else 2), path
        assert len({len(rows) for rows in packed}) > 1, path
        assert not set(packed) & set(padded), path
        assert sum(len(rows) for rows in packed) == 16, path


@pytest.mark.parametrize("path", list(P.PATHS))
def test_forking_micro_batch_scope_follows_what_each_micro_batch_holds(results, trained, path):
    """``scope=micro_batch`` equals its per-micro-batch formula on every path, and the token-budget paths, whose
    micro-batches hold other rows, report another loss than the padded path."""
    result = results[path, None]
    cfg = S.compose_config("forking_micro_batch", "unused", P.PATHS[path].overrides)
    records = result.updates["forking_micro_batch"].micro_batches
    predicted = S.forking_micro_batch_loss(cfg, result.batches["forking_micro_batch"], records, trained)
    observed = result.updates["forking_micro_batch"].metrics["actor/pg_loss"]
    if P.PATHS[path].dp == 1:  # rank 0's micro-batches are the whole mini-batch
        assert observed == pytest.approx(predicted, rel=LOSS_RTOL)
    padded = results["padded", None].updates["forking_micro_batch"].metrics["actor/pg_loss"]
    if path in ("dynamic_bsz", "chunked_entropy", "checkpointing", "offload"):
        assert abs(observed - padded) > 100 * LOSS_RTOL * abs(padded)


def test_the_method_preset_selects_forking_tokens_over_the_whole_batch():
    cfg = S.compose_config("forking_micro_batch", "unused", P.PRESET)
    assert cfg.algorithm.forking.scope == "micro_batch"  # the harness's explicit override
    from tests.support.configs import compose

    preset = compose(["method=dapo_forking"])
    assert preset.algorithm.forking.scope == "batch"


@pytest.mark.parametrize("fault,path", list(P.FAULTS.items()))
def test_a_planted_fault_fails_the_comparison(results, fault, path):
    padded, faulty = results["padded", None], results[path, fault]
    assert_same_old_pass(padded, results[path, None])
    with pytest.raises(AssertionError, match=r"differ"):
        assert_same_old_pass(padded, faulty)
    log_probs, entropy = worst_old_difference(padded, faulty)
    assert max(log_probs, entropy) > 1000 * OLD_ATOL
