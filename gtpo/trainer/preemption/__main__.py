"""``python -m gtpo.trainer.preemption request [--wait S]``: ask every gtpo trainer on a Ray cluster to save after its
step in flight and exit (a Kubernetes preStop hook, ``scripts/k8s/rayjob.yaml``); ``--wait`` returns once a trainer
has saved.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from gtpo.trainer.preemption.channel import CLUSTER_KEY, SAVED_KEY, get_request, put_request
from gtpo.trainer.preemption.stop import EXIT_CODE


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
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        saved = get_request(SAVED_KEY, asked)
        if saved:
            print(f"gtpo preemption: the trainer saved ({saved})", file=sys.stderr)
            return 0
        time.sleep(2.0)
    return 0 if args.wait == 0 else 3


if __name__ == "__main__":
    sys.exit(main())
