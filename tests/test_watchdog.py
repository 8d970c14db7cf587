"""The stage watchdog (gtpo.trainer.guard.watchdog) without Ray: deadlines, progress, the expiry path, the hooks.

The end-to-end check, a real weight sync broken on purpose, is in tests/test_e2e_vllm.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from verl.utils.ray_utils import auto_await

from gtpo.knobs import WatchdogParams
from gtpo.trainer.guard import watchdog as wd
from gtpo.trainer.guard.watchdog import EXIT_CODE, StageTimeoutError, StageWatchdog


def test_a_stage_that_ends_in_time_passes():
    dog = StageWatchdog(poll_s=0.01)
    with dog.stage("weight sync", 5.0, "algorithm.watchdog.weight_sync_s"):
        time.sleep(0.05)
    assert dog.expired is None


def test_a_blocked_stage_is_released_by_on_expire_and_raises_naming_the_stage():
    released = threading.Event()
    calls = []

    def on_expire(message):
        calls.append(message)
        released.set()  # what stopping the worker actors does to a blocked ray.get

    dog = StageWatchdog(on_expire=on_expire, poll_s=0.01)
    start = time.monotonic()
    with pytest.raises(StageTimeoutError) as info:
        with dog.stage("weight sync (update_weights)", 0.3, "algorithm.watchdog.weight_sync_s", lambda: "no reply"):
            released.wait(30)  # a C-level wait: only the watchdog thread can end it
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 5.0
    text = str(info.value)
    assert text.startswith("gtpo watchdog: stage 'weight sync (update_weights)' made no progress for")
    assert "over its limit algorithm.watchdog.weight_sync_s=0.3: no reply" in text
    assert calls == [text]


def test_progress_keeps_a_long_stage_alive():
    dog = StageWatchdog(on_expire=lambda m: pytest.fail(m), poll_s=0.01)
    with dog.stage("generation", 0.2, "algorithm.watchdog.generation_s"):
        for _ in range(10):  # 0.5 s in all, never 0.2 s without progress
            time.sleep(0.05)
            dog.progress()
            dog.check()
    assert dog.expired is None


def test_check_raises_from_the_stage_loop_without_stopping_workers():
    dog = StageWatchdog(on_expire=lambda m: pytest.fail("the loop raises itself"), poll_s=5.0)
    with pytest.raises(
        StageTimeoutError, match=r"stage 'generation' made no progress for 0\.\d s, .*generation_s=0\.1$"
    ):
        with dog.stage("generation", 0.1, "algorithm.watchdog.generation_s"):
            while True:
                time.sleep(0.02)
                dog.check()


def test_a_stage_that_never_returns_ends_the_process_after_the_grace_period():
    exits = []
    stuck = threading.Event()

    def exit_fn(code):
        exits.append(code)
        stuck.set()

    dog = StageWatchdog(on_expire=lambda m: None, grace_s=0.2, poll_s=0.01, exit_fn=exit_fn)
    with pytest.raises(StageTimeoutError):
        with dog.stage("weight sync", 0.1, "algorithm.watchdog.weight_sync_s"):
            stuck.wait(30)  # on_expire released nothing: only the exit ends it
    assert exits == [EXIT_CODE]


def test_zero_limit_and_nested_stages():
    dog = StageWatchdog(poll_s=0.01)
    with dog.stage("off", 0, "k"):
        time.sleep(0.05)
    with pytest.raises(StageTimeoutError, match="stage 'outer'"):
        with dog.stage("outer", 0.1, "k.outer"):
            with dog.stage("inner", 100.0, "k.inner"):  # the outer stage's deadline stays in force
                while True:
                    time.sleep(0.02)
                    dog.check()


@pytest.mark.parametrize(
    "values, message",
    [
        ({"weight_sync_s": -1}, r"algorithm\.watchdog\.weight_sync_s=-1: must be a number of seconds >= 0"),
        ({"generation_s": "10"}, r"algorithm\.watchdog\.generation_s='10': must be a number"),
        ({"grace_s": 0}, r"algorithm\.watchdog\.grace_s=0: must be > 0"),
        ({"weight_sync": 10}, r"unknown key\(s\) algorithm\.watchdog\.weight_sync"),
    ],
)
def test_bad_knobs_fail_at_startup_naming_the_key(values, message):
    from gtpo.methods import knob

    with pytest.raises(ValueError, match=message):
        knob(OmegaConf.create({"watchdog": values}), "watchdog")


def test_recipe_defaults_parse():
    from gtpo.methods import knob

    cfg = OmegaConf.load(wd.__file__.replace("gtpo/trainer/guard/watchdog.py", "recipe/gtpo/config/gtpo_trainer.yaml"))
    assert knob(cfg.algorithm, "watchdog") == WatchdogParams(1800, 1800, 60)


# ------------------------------------------------------------------------------------------------- the hooks


def _trainer(**watchdog):
    return SimpleNamespace(config=OmegaConf.create({"algorithm": {"watchdog": watchdog}}))


class _Buffer:
    """The replay buffer surface the hook uses: the four key sets, sample() and its polling wait."""

    def __init__(self, finish_after: int | None):
        self.pending_keys = {"train": {"a", "b"}}
        self.running_keys = {"train": set()}
        self.finished_keys = {"train": set()}
        self.failure_keys = {"train": set()}
        self.finish_after = finish_after
        self.polls = 0

    def _wait_for_next_poll(self, partition_id, last_debug_time):
        time.sleep(0.02)
        self.polls += 1
        if self.finish_after is not None and self.polls % self.finish_after == 0 and self.pending_keys[partition_id]:
            self.finished_keys[partition_id].add(self.pending_keys[partition_id].pop())
        return last_debug_time

    def sample(self, global_steps, partition_id, batch_size):
        while len(self.finished_keys[partition_id]) < batch_size:
            self._wait_for_next_poll(partition_id, 0.0)
        return "batch", {}


def test_generation_without_progress_fails_naming_the_counts():
    buffer = wd.watch_generation(_Buffer(finish_after=None), _trainer(generation_s=0.2))
    with pytest.raises(StageTimeoutError) as info:
        buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert "stage 'generation'" in str(info.value) and "algorithm.watchdog.generation_s=0.2" in str(info.value)
    assert "2 pending, 0 running, 0 finished, 0 failed" in str(info.value)


def test_slow_but_moving_generation_passes():
    # one response finishes every 0.1 s: slower in total than the limit, never idle for it
    buffer = wd.watch_generation(_Buffer(finish_after=5), _trainer(generation_s=0.3))
    assert buffer.sample(global_steps=1, partition_id="train", batch_size=2) == ("batch", {})


class _ResponseBuffer(_Buffer):
    """Prompts stay 'running' while their responses are stored one by one (verl: a prompt turns terminal only when
    all rollout.n sessions have settled; each finished session's trajectory key appears in ``partitions`` first)."""

    def __init__(self, store_every: int | None, responses: int = 8):
        super().__init__(finish_after=None)
        self.running_keys["train"] = self.pending_keys["train"]
        self.pending_keys["train"] = set()
        self.partitions = {"train": {}}
        self.store_every, self.responses = store_every, responses

    def _wait_for_next_poll(self, partition_id, last_debug_time):
        time.sleep(0.02)
        self.polls += 1
        if self.store_every is not None and self.polls % self.store_every == 0:
            stored = self.partitions[partition_id]
            stored[f"a_{len(stored)}"] = {}
        return last_debug_time

    def sample(self, global_steps, partition_id, batch_size):
        while len(self.partitions[partition_id]) < self.responses:
            self._wait_for_next_poll(partition_id, 0.0)
        return "batch", {}


def test_stored_responses_count_as_progress_while_no_prompt_settles():
    # one response every 0.1 s, 8 in all (0.8 s): no prompt changes status within the 0.3 s limit
    buffer = wd.watch_generation(_ResponseBuffer(store_every=5), _trainer(generation_s=0.3))
    assert buffer.sample(global_steps=1, partition_id="train", batch_size=2) == ("batch", {})
    assert buffer.polls >= 35


def test_running_prompts_without_stored_responses_expire():
    buffer = wd.watch_generation(_ResponseBuffer(store_every=None), _trainer(generation_s=0.2))
    with pytest.raises(StageTimeoutError) as info:
        buffer.sample(global_steps=1, partition_id="train", batch_size=2)
    assert "prompts 0 pending, 2 running, 0 finished, 0 failed; 0 responses stored" in str(info.value)


def test_generation_limit_zero_leaves_the_buffer_alone():
    buffer = _Buffer(finish_after=None)
    assert wd.watch_generation(buffer, _trainer(generation_s=0)).sample.__func__ is _Buffer.sample


def test_a_stalled_weight_sync_stops_the_workers_and_raises(monkeypatch):
    released = threading.Event()

    class Manager:
        def update_weights(self, global_steps=None):
            released.wait(30)  # verl: ray.get on the actor workers, whose sender waits for the vLLM worker

        def sleep_replicas(self):
            return "slept"

    trainer = _trainer(weight_sync_s=0.2)
    trainer.checkpoint_manager = Manager()
    stopped = []
    monkeypatch.setattr(wd, "stop_workers", lambda t: (stopped.append(t), released.set()))
    wd.watch_weight_sync(trainer)
    wd.watch_weight_sync(trainer)  # idempotent: one wrapper
    assert trainer.checkpoint_manager.sleep_replicas() == "slept"
    with pytest.raises(StageTimeoutError, match=r"stage 'weight sync \(update_weights\)'.*weight_sync_s=0\.2"):
        trainer.checkpoint_manager.update_weights(global_steps=3)
    assert stopped == [trainer]


class _StandaloneManager:
    """verl's CheckpointEngineManager surface under separate_async (nccl backend): ``update_weights`` is an
    ``auto_await`` coroutine that awaits the manager's own ``auto_await`` coroutines, then blocks in ``ray.get``."""

    def __init__(self, stall: threading.Event | None = None):
        self.stall = stall
        self.calls: list[str] = []

    @auto_await
    async def abort_replicas(self, reject_request: bool = False):
        self.calls.append("abort")

    @auto_await
    async def resume_generation_replicas(self):
        self.calls.append("resume")

    @auto_await
    async def update_weights(self, global_steps: int = None):
        await self.abort_replicas()
        if self.stall is not None:
            self.stall.wait(30)  # ray.get on the actor and standalone rollout workers (the NCCL broadcast)
        await self.resume_generation_replicas()
        return {"sync/step": global_steps}


def _separate_async_trainer(standalone, weight_sync_s=0.2):
    trainer = _trainer(weight_sync_s=weight_sync_s)
    trainer.checkpoint_manager = SimpleNamespace(replicas=[])  # hybrid_engine=false: the naive manager, no replicas
    trainer.standalone_checkpoint_manager = standalone
    return trainer


def test_a_stalled_standalone_weight_sync_stops_the_workers_and_raises(monkeypatch):
    released = threading.Event()
    trainer = _separate_async_trainer(_StandaloneManager(stall=released))
    stopped = []
    monkeypatch.setattr(wd, "stop_workers", lambda t: (stopped.append(t), released.set()))
    wd.watch_weight_sync(trainer)
    wd.watch_weight_sync(trainer)  # idempotent: one wrapper
    manager = trainer.standalone_checkpoint_manager
    # only the outer call is wrapped: its inner coroutines stay verl's own
    assert manager.abort_replicas.__func__ is _StandaloneManager.abort_replicas
    start = time.monotonic()
    with pytest.raises(
        StageTimeoutError,
        match=r"stage 'weight sync \(standalone update_weights\)'.*weight_sync_s=0\.2: verl's standalone checkpoint",
    ):
        manager.update_weights(7)  # verl: on_step_end / on_init_end, plain code
    assert time.monotonic() - start < 5.0
    assert stopped == [trainer] and manager.calls == ["abort", "resume"]


def test_the_wrapped_standalone_weight_sync_returns_its_metrics_from_plain_and_async_callers():
    trainer = _separate_async_trainer(_StandaloneManager(), weight_sync_s=30)
    wd.watch_weight_sync(trainer)
    manager = trainer.standalone_checkpoint_manager

    def plain_caller():
        return manager.update_weights(3)

    async def awaiting_caller():
        return await manager.update_weights(4)  # auto_await hands an async caller the coroutine

    async def plain_caller_inside_a_loop():
        return plain_caller()  # auto_await runs it on a thread of its own

    assert plain_caller() == {"sync/step": 3}
    assert asyncio.run(awaiting_caller()) == {"sync/step": 4}
    assert asyncio.run(plain_caller_inside_a_loop()) == {"sync/step": 3}
    assert manager.calls == ["abort", "resume"] * 3
    assert trainer._gtpo_watchdog.expired is None


def test_stop_workers_kills_the_standalone_pool_too(monkeypatch):
    import ray

    killed = []

    def kill(handle, no_restart):
        assert no_restart is True
        killed.append(handle)
        if handle == "pool-worker-1":
            raise ValueError("actor already dead")

    monkeypatch.setattr(ray, "kill", kill)
    actors = ["actor-0", "actor-1"]
    trainer = SimpleNamespace(
        actor_rollout_wg=SimpleNamespace(workers=actors),
        # hybrid replicas' workers are the actor workers themselves: killed once
        checkpoint_manager=SimpleNamespace(replicas=[SimpleNamespace(servers=["hybrid-server"], workers=actors)]),
        standalone_checkpoint_manager=SimpleNamespace(
            replicas=[
                SimpleNamespace(servers=["pool-server-0"], workers=["pool-worker-0", "pool-worker-1"]),
                SimpleNamespace(servers=["pool-server-1"], workers=["pool-worker-2"]),
            ]
        ),
    )
    assert wd.stop_workers(trainer) == 7  # the dead one is not counted, and the kills after it still happen
    assert killed == [
        "actor-0",
        "actor-1",
        "hybrid-server",
        "pool-server-0",
        "pool-worker-0",
        "pool-worker-1",
        "pool-server-1",
        "pool-worker-2",
    ]


def test_find_expiry_reads_the_message_out_of_a_ray_log():
    message = (
        "gtpo watchdog: stage 'weight sync (update_weights)' made no progress for 31 s, over its limit "
        "algorithm.watchdog.weight_sync_s=30: verl's checkpoint manager update_weights() did not return"
    )
    log = f"noise\n\x1b[36m(GTPOTaskRunner pid=7)\x1b[0m {message}\nmore\n{message}\n"
    assert wd.find_expiry(log) == message
    assert wd.find_expiry("no expiry here") is None
