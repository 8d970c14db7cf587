"""Each of verl's workers checks the checkpoint files it is about to load, in its own process (seam
``checkpoint-load-check``, docs/architecture.md).

verl's ``FSDPCheckpointManager.load_checkpoint`` reads the rank's model, optimizer and extra-state files with
``torch.load(weights_only=False)``, which runs whatever a planted file holds. Installed by
:mod:`gtpo.verl_plugin.register` in every process that imports verl, the wrapper refuses the role folder
(``actor/``, ``critic/``) first unless nobody else could have written into it
(:func:`gtpo.private_files.check_private_tree`): right before the load, on the node that loads it.
"""

from __future__ import annotations

import functools

from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

from gtpo.private_files import check_private_tree

__all__ = ["checked_load", "install"]

_CHECKED = "__gtpo_checks_files__"


def checked_load(load):
    """``load`` (verl's ``load_checkpoint``) after :func:`gtpo.private_files.check_private_tree` of its folder."""

    @functools.wraps(load)
    def load_checkpoint(self, local_path, *args, **kwargs):
        if local_path is not None:
            try:
                check_private_tree(local_path, "checkpoint")
            except OSError as err:
                raise RuntimeError(f"cannot resume: {err}") from None
        return load(self, local_path, *args, **kwargs)

    setattr(load_checkpoint, _CHECKED, True)
    return load_checkpoint


def install() -> None:
    """Wrap ``FSDPCheckpointManager.load_checkpoint`` once per process."""
    if not getattr(FSDPCheckpointManager.load_checkpoint, _CHECKED, False):
        FSDPCheckpointManager.load_checkpoint = checked_load(FSDPCheckpointManager.load_checkpoint)
