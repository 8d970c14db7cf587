"""A deterministic pseudo-random reward for end-to-end plumbing tests.

A random tiny model never solves a math problem, so the real verifier would give every group the same reward and
every group-relative method would see no signal. This reward is +1 or -1 by the CRC32 of the response text, so
groups have mixed outcomes and every estimator, filter and loss path has work to do.
"""

import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    correct = zlib.crc32(solution_str.encode("utf-8")) % 2 == 1
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": solution_str[:8]}
