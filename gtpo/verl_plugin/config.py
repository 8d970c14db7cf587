"""The plugin's one setting outside the config: the list of modules verl imports in every process.

``VERL_USE_EXTERNAL_MODULES`` is a comma-separated list; the recipe's entry point and the CPU backend each add
their modules to whatever the user set. The typed knob blocks (``algorithm.*``) are read by :mod:`gtpo.knobs`.
"""

from __future__ import annotations

__all__ = ["merge_module_list"]


def merge_module_list(*values: str | None) -> str:
    """Comma-joined union of ``VERL_USE_EXTERNAL_MODULES``-style lists, order kept, duplicates and blanks dropped."""
    seen: list[str] = []
    for value in values:
        for name in (value or "").split(","):
            name = name.strip()
            if name and name not in seen:
                seen.append(name)
    return ",".join(seen)
