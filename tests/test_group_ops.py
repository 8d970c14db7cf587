"""Group reductions (gtpo/algorithms/group_ops.py): group id numbering and per-group sums.

Run: .venv/bin/python -m pytest -q tests/test_group_ops.py
"""

from __future__ import annotations

import numpy as np
import torch

from gtpo.algorithms.group_ops import group_ids, segment_sum


def test_group_ids_numbered_by_first_appearance():
    # sorted labels would number "a" first; first appearance numbers "b" first
    gid, ng = group_ids(np.asarray(["b", "a", "b", "c", "a"], dtype=object))
    assert ng == 3 and gid.tolist() == [0, 1, 0, 2, 1]
    gid, ng = group_ids(torch.tensor([7, 3, 7, 1]))
    assert ng == 3 and gid.tolist() == [0, 1, 0, 2]


def test_segment_sum_by_group_id_not_position():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    out = segment_sum(x, torch.tensor([1, 0, 1]), 2)
    torch.testing.assert_close(out, torch.tensor([[3.0, 4.0], [6.0, 8.0]]))
