"""Facts the docs state more than once, held to the code that makes them.

    .venv/bin/python -m pytest -q -n 0 tests/test_doc_facts.py

The 32B and 7B checkpoint sizes (12 bytes per parameter of the presets' models), the smoke run's one GPU, a download
line for every model preset, the README's first screen saying no GPU run is on record, and the test tiers that
docs/cpu-backend.md names.
"""

from __future__ import annotations

import re
from pathlib import Path

from gtpo.launch.runs import preset_counts, presets, read_preset
from gtpo.launch.state_memory import KNOWN_MODELS

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _text(name: str) -> str:
    return (REPO / name).read_text()


def _checkpoint_gb(model: str) -> int:
    """verl's FSDP checkpoint: fp32 weights and AdamW's two fp32 moments, 12 bytes per parameter."""
    return round(KNOWN_MODELS[model].parameters * 12 / 1e9)


def test_every_page_gives_the_checkpoint_size_the_parameters_make():
    big, small = _checkpoint_gb("Qwen2.5-32B"), _checkpoint_gb("Qwen2.5-7B")
    assert (big, small) == (393, 91)  # 32,763,876,352 and 7,615,616,512 parameters
    assert re.search(r"\| one checkpoint \| (\d+) GB \| (\d+) GB \|", _text("docs/cluster.md")).groups() == (
        str(small),
        str(big),
    )
    assert f"{big} GB at 32B" in _text("docs/cost.md")
    resume = _text("docs/resume-and-preemption.md")
    assert f"32.76 B × 12 B = {big} GB" in resume and f"| Qwen2.5-32B, 4 × 8 GPUs | {big} GB (98 GB)" in resume
    for page in [*DOCS.glob("*.md"), REPO / "README.md"]:
        assert not re.search(r"\b(390|394) GB", page.read_text()), page


def test_the_smoke_run_is_one_gpu_everywhere():
    assert preset_counts("qwen2.5_0.5b", None, (), {}) == (1, 1)
    assert "The smoke run (one GPU," in _text("README.md")
    cluster = _text("docs/cluster.md")
    assert "LAUNCH_SCRIPT=scripts/run_smoke_qwen2.5_0.5b.sh sbatch --nodes=1 --gpus-per-node=1" in cluster
    assert "job's pods on one GPU, as everywhere" in cluster and "8 FSDP ranks" not in cluster


def test_the_readme_downloads_every_model_presets_model():
    downloaded = set()
    for names in re.findall(r"for m in ([\w. -]+); do \\?\s*\S*hf download Qwen/\$m", _text("README.md")):
        downloaded |= set(names.split())
    hub_names = {read_preset("model", m)["actor_rollout_ref"]["model"]["path"].split("/")[1] for m in presets("model")}
    assert hub_names <= downloaded, sorted(hub_names - downloaded)


def test_the_readme_first_screen_says_no_gpu_run_is_on_record():
    first_screen = " ".join(_text("README.md").splitlines()[:12])
    assert "No GPU run of this recipe is on record yet" in first_screen
    assert "the one-GPU smoke run" in first_screen and "is the first real test of its GPU path" in first_screen


def test_cpu_backend_places_the_e2e_runs_in_the_tiers_their_markers_do():
    text = " ".join(_text("docs/cpu-backend.md").split())
    sentence = re.search(r"The default test tier runs on a two-node cluster.*?as \[tests\.md\]", text).group(0)
    default_part, slow_part = sentence.split("are in the slow tier")[0].rsplit(";", 1)
    named_slow = re.findall(r"`(tests/test_\w+\.py)`", slow_part)
    assert named_slow == ["tests/test_e2e_resume.py", "tests/test_compare.py"]
    for path in named_slow:
        assert re.search(r"pytest\.mark\.slow", _text(path)), f"{path} is not in the slow tier"
    assert "kill-and-resume" not in default_part and "comparison" not in default_part
