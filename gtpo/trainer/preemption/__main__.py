"""``python -m gtpo.trainer.preemption request [--wait S]``: ask every gtpo trainer on a Ray cluster to save after its
step in flight and exit (a Kubernetes preStop hook, ``scripts/k8s/rayjob.yaml``); ``--wait`` returns once a trainer
has saved, or at once when no trainer runs on the cluster (:mod:`gtpo.trainer.preemption.presence`: a job that has
ended, or one still starting, has nothing to save).

Exit status with ``--wait``: 0 when a trainer saved (or ended), :data:`NO_TRAINER_EXIT` when none was running,
3 when the wait ran out, 1 without a cluster.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from gtpo.trainer.preemption.channel import CLUSTER_KEY, SAVED_KEY, get_request, put_request
from gtpo.trainer.preemption.presence import live_trainers
from gtpo.trainer.preemption.stop import EXIT_CODE

# `request --wait` found no trainer to wait for (the KubeRay head's hook then does not wait for the driver either).
NO_TRAINER_EXIT = 4
TIMEOUT_EXIT = 3
POLL_S = 2.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gtpo.trainer.preemption",
        description="Ask every gtpo trainer on a Ray cluster to save after its step in flight and exit "
        f"{EXIT_CODE} (e.g. from a Kubernetes preStop hook).",
    )
    parser.add_argument("command", choices=["request"])
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"), help="the cluster [auto]")
    parser.add_argument("--reason", default="python -m gtpo.trainer.preemption request")
    parser.add_argument(
        "--wait", type=float, default=0.0, metavar="S", help="then wait up to S seconds for the trainer's save [0]"
    )
    args = parser.parse_args(argv)
    import ray

    try:
        ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        print(f"gtpo preemption: no Ray cluster at --address={args.address}: {err}", file=sys.stderr)
        return 1
    asked = time.time()
    put_request(CLUSTER_KEY, args.reason)
    print(f"gtpo preemption: stop requested on the cluster at {args.address}", file=sys.stderr)
    if args.wait == 0:
        return 0
    return wait_for_save(asked, time.monotonic() + args.wait)


def wait_for_save(asked: float, deadline: float, sleep=time.sleep, clock=time.monotonic) -> int:
    """Poll until a trainer announces its save (0), no trainer is left (0, or :data:`NO_TRAINER_EXIT` when none ran
    at the request) or ``deadline`` (:data:`TIMEOUT_EXIT`)."""
    trainers = live_trainers()
    if not trainers:
        print("gtpo preemption: no gtpo trainer runs on the cluster: nothing to save, not waiting", file=sys.stderr)
        return NO_TRAINER_EXIT
    print(f"gtpo preemption: waiting for the save of {', '.join(trainers)}", file=sys.stderr, flush=True)
    while clock() < deadline:
        saved = get_request(SAVED_KEY, asked)
        if saved:
            print(f"gtpo preemption: the trainer saved ({saved})", file=sys.stderr)
            return 0
        if not live_trainers() and not get_request(SAVED_KEY, asked):
            print("gtpo preemption: the trainer ended without a stop save (its run was over)", file=sys.stderr)
            return 0
        sleep(POLL_S)
    print("gtpo preemption: no save announced before --wait ran out", file=sys.stderr)
    return TIMEOUT_EXIT


if __name__ == "__main__":
    sys.exit(main())
