"""The estimators' numba kernels inside Ray actors, with the thread counts Ray gives them.

verl computes advantages in its TaskRunner, a Ray actor started without ``num_cpus``: Ray sets ``OMP_NUM_THREADS=1``
there, so torch and the kernels run one thread. An actor with ``num_cpus=2`` gets two; the kernels then split rows
over two plain threads while torch's OpenMP pool is busy between calls. Neither may oversubscribe, deadlock, start
numba's own threading layer, or leave threads behind that a fork would inherit.

Run: .venv/bin/python -m pytest -q tests/test_kernel_ray.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = str(Path(__file__).resolve().parents[1])


def _env():
    path = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": REPO + (os.pathsep + path if path else "")}}


def _batch(rows=512, length=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gid = torch.randperm(rows, generator=gen) % (rows // 8)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    entropy = torch.rand(rows, length, generator=gen) * mask
    rewards = (torch.rand(rows, generator=gen) < 0.5).float()
    responses = torch.randint(0, 4, (rows, length), generator=gen) * mask.long()
    return entropy, mask, rewards, gid, rows // 8, responses


def _run_all(entropy, mask, rewards, gid, ng, responses):
    """The three estimators through their kernels; returns the advantages and the thread counts used."""
    from gtpo.algorithms import kernel_dispatch, kernels
    from gtpo.algorithms.grpo_s import grpo_s_advantages
    from gtpo.algorithms.gtpo_token import GTPOParams, gtpo_token_advantages
    from gtpo.algorithms.gtpo_traj import GTPOTrajParams, trajectory

    gtpo, _ = gtpo_token_advantages(entropy, mask, rewards, gid, ng, GTPOParams(conflict_mask=True), None, responses)
    grpo_s, _ = grpo_s_advantages(entropy, mask, rewards, gid, ng)
    traj = trajectory(rewards, mask, responses, entropy, gid, ng, GTPOTrajParams(h_ini=0.3)).advantages
    assert kernel_dispatch.kernel_on("gtpo_token")  # the kernels ran, not the definitions
    return {
        "adv": (gtpo, grpo_s, traj),
        "torch_threads": torch.get_num_threads(),
        "kernel_threads": kernels.num_threads(len(rewards)),
        "omp": os.environ.get("OMP_NUM_THREADS"),
    }


@pytest.fixture(scope="module")
def runner_cls(ray_session):
    ray = ray_session

    class KernelRunner:
        def run(self, batch, rounds=1):
            import numba.np.ufunc.parallel as numba_parallel

            out = None
            for _ in range(rounds):
                out = _run_all(*batch)
                torch.randn(256, 256) @ torch.randn(256, 256)  # torch's OpenMP pool between the kernels
            out["numba_threading_layer_started"] = bool(numba_parallel._is_initialized)
            return out

        def fork_and_run(self, batch):
            """A forked child runs the kernels again (nothing of the parent's kernel threads may hang it)."""
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                try:
                    # GNU OpenMP's thread pool does not survive a fork: a child of a process that ran torch's
                    # parallel regions must use one torch thread (torch's own rule; its first fill would hang)
                    torch.set_num_threads(1)
                    _run_all(*batch)
                    os._exit(0)
                except BaseException:
                    os._exit(1)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)

    return ray.remote(KernelRunner)


def _expected(batch):
    from gtpo.algorithms.grpo_s import grpo_s_definition
    from gtpo.algorithms.gtpo_token import GTPOParams, gtpo_token_definition
    from gtpo.algorithms.gtpo_traj import GTPOTrajParams, centred_advantages, gtpo_traj_definition

    entropy, mask, rewards, gid, ng, responses = batch
    gtpo, _ = gtpo_token_definition(entropy, mask, rewards, gid, ng, GTPOParams(conflict_mask=True), None, responses)
    grpo_s, _ = grpo_s_definition(entropy, mask, rewards, gid, ng)
    params = GTPOTrajParams(h_ini=0.3)
    adv, pol, zv = centred_advantages(rewards, gid, ng, params.adv_norm, params.eps)
    traj = gtpo_traj_definition(mask, responses, entropy, gid, ng, params, adv, pol, zv, 0.3).advantages
    return gtpo, grpo_s, traj


def _assert_matches(got, batch):
    for adv, ref in zip(got, _expected(batch)):
        torch.testing.assert_close(adv, ref, rtol=1e-5, atol=1e-6)


def test_in_a_default_actor_the_kernels_run_one_thread(ray_session, runner_cls):
    """Ray gives an actor without num_cpus OMP_NUM_THREADS=1 (verl's TaskRunner is one): one thread, no numba pool."""
    ray = ray_session
    batch = _batch()
    actor = runner_cls.options(runtime_env=_env()).remote()
    out = ray.get(actor.run.remote(batch), timeout=600)
    assert out["omp"] == "1" and out["torch_threads"] == 1 and out["kernel_threads"] == 1
    assert not out["numba_threading_layer_started"]
    _assert_matches(out["adv"], batch)
    assert ray.get(actor.fork_and_run.remote(batch), timeout=300) == 0
    ray.kill(actor)


def test_in_a_two_cpu_actor_the_kernels_run_two_threads_without_deadlock(ray_session, runner_cls):
    ray = ray_session
    batch = _batch(seed=1)
    actor = runner_cls.options(num_cpus=2, runtime_env=_env()).remote()
    out = ray.get(actor.run.remote(batch, rounds=5), timeout=600)  # a hang fails here, on the timeout
    assert out["omp"] == "2" and out["torch_threads"] == 2 and out["kernel_threads"] == 2
    assert not out["numba_threading_layer_started"]
    _assert_matches(out["adv"], batch)
    assert ray.get(actor.fork_and_run.remote(batch), timeout=300) == 0
    ray.kill(actor)
