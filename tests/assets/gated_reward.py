"""coin_reward's score behind a gate the test holds: once the run has saved a checkpoint (the tracker file in
``GTPO_TEST_GATE_CKPTS`` exists), every call writes the marker ``<GTPO_TEST_GATE>/held`` and waits until the test
writes ``<GTPO_TEST_GATE>/release``. The run then stands still, alive, at a step the test knows (the one after the
first save), for as long as the test needs, whatever the machine's speed (tests/test_eval_checkpoint.py)."""

import os
import time
import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    gate, ckpts = os.environ.get("GTPO_TEST_GATE"), os.environ.get("GTPO_TEST_GATE_CKPTS")
    if gate and ckpts and os.path.exists(os.path.join(ckpts, "latest_checkpointed_iteration.txt")):
        with open(os.path.join(gate, "held"), "w"):
            pass
        while not os.path.exists(os.path.join(gate, "release")):
            time.sleep(0.2)
    correct = zlib.crc32(solution_str.encode("utf-8")) % 2 == 1
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": solution_str[:8]}
