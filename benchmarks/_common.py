"""Shared helpers of the benchmark scripts: machine description, RSS high-water, RESULTS.md sections.

Each benchmark owns one section of ``benchmarks/RESULTS.md``, delimited by ``<!-- BEGIN name -->`` and
``<!-- END name -->``; :func:`write_section` replaces only that section (appending it when absent), so benchmarks
never overwrite each other's results.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def mem_total_gb() -> float:
    try:
        m = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
        return int(m.group(1)) / 2**20 if m else float("nan")
    except OSError:
        return float("nan")


def mem_available_gb() -> float:
    try:
        m = re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text())
        return int(m.group(1)) / 2**20 if m else float("nan")
    except OSError:
        return float("nan")


def machine(device: str = "cpu") -> str:
    import torch

    desc = (
        f"{os.cpu_count()} cores ({cpu_model()}), {mem_total_gb():.0f} GB RAM, Python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), {platform.system()}"
    )
    if device.startswith("cuda") and torch.cuda.is_available():
        desc += f", GPU {torch.cuda.get_device_name(0)}"
    try:
        load = os.getloadavg()[0]
        desc += f", 1-minute load average {load:.1f} when written"
    except OSError:
        pass
    return desc


def command_line() -> str:
    args = [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]
    return ".venv/bin/python " + " ".join(shlex.quote(a) for a in args)


def stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux ``/proc/self/clear_refs``); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """RSS high-water mark of this process in MiB (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    try:
        m = re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())
        if m:
            return int(m.group(1)) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    try:
        m = re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text())
        if m:
            return int(m.group(1)) / 1024
    except OSError:
        pass
    return float("nan")


def write_section(name: str, title: str, body: str, path: Path = RESULTS) -> None:
    """Replace (or append) the ``name`` section of RESULTS.md; other sections are left byte-for-byte intact.

    The section is ``## title`` followed by ``<!-- BEGIN name -->`` ... ``<!-- END name -->``; the heading comes
    first so that scripts which find a section's end by the next ``## `` heading (bench_reward.py) stop before it.
    """
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"## {title}\n{begin}\n\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if begin in text and end in text:
        i, j = text.index(begin), text.index(end) + len(end)
        head = text.rfind("\n", 0, max(i - 1, 0)) + 1  # start of the line before the marker
        if text[head:i].startswith("## "):
            i = head
        if j < len(text) and text[j] == "\n":
            j += 1
        text = text[:i] + block + text[j:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def report(name: str, title: str, text: str, write: bool = True) -> str:
    """``text`` under a stamped heading with the command line and the machine: printed, and written as section
    ``name`` of RESULTS.md unless ``write`` is false; returns the section's body."""
    body = f"### {stamp()}\n\n`{command_line()}`  \nMachine: {machine()}  \n{text}"
    print(body)
    if write:
        write_section(name, title, body)
    return body
