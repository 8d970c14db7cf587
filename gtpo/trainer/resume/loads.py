"""The recipe's own reads of checkpoint shard files, each checked right before it is read and read as data; the check of
a whole checkpoint folder right before verl loads it (:func:`refuse_unless_private`: the trainer's, each worker's).

:func:`load_checkpoint_file` refuses a file that is a symlink, not this user's, or writable by group or others
(:func:`gtpo.private_files.check_private_file`), then reads it with ``torch.load(weights_only=True)``: tensors,
DTensors (admitted by torch once ``torch.distributed.tensor`` is imported) and plain containers, never code. The one
non-tensor object verl's files hold is NumPy's RNG state in ``extra_state_*`` files (``get_rng_state``: a uint32 key
array), admitted by name. verl's own loads stay ``torch.load(weights_only=False)`` (docs/architecture.md, seam
``checkpoint-load-check``).
"""

from __future__ import annotations

import os
from typing import Any

from gtpo.private_files import check_private_file

__all__ = ["load_checkpoint_file", "numpy_rng_globals", "refuse_unless_private"]


def numpy_rng_globals() -> list[Any]:
    """What unpickling ``numpy.random.get_state()`` needs: an ndarray of uint32 rebuilt by NumPy's own function."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # NumPy 2 renamed numpy.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def load_checkpoint_file(path: str | os.PathLike, what: str = "a checkpoint file", mmap: bool = True) -> Any:
    """``torch.load`` of ``path`` as data only, after :func:`gtpo.private_files.check_private_file`; raises
    ``PermissionError`` for a file others could have written, torch's ``UnpicklingError`` naming anything but data."""
    import torch
    import torch.distributed.tensor  # noqa: F401 - registers DTensor and its specs with weights_only loading

    check_private_file(path, what)
    with torch.serialization.safe_globals(numpy_rng_globals()):
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)


def refuse_unless_private(folder: str | os.PathLike, what: str = "checkpoint", inside: bool = True) -> None:
    """Refuse the checkpoint ``folder`` (``RuntimeError``, one line naming it and why) unless nobody else could have
    written what will be loaded from it (:func:`gtpo.private_files.check_private_tree`; without ``inside`` the folder
    alone, for a run's ``default_local_dir`` before anything in it is read or renamed)."""
    from gtpo.private_files import check_private_dir, check_private_tree, check_unswappable_parents

    try:
        if inside:
            check_private_tree(folder, what)
        else:
            check_unswappable_parents(folder, what)
            check_private_dir(folder, what)
    except OSError as err:
        raise RuntimeError(f"cannot resume: {err}") from None
