"""verl's real trainer (CPU demo task, 2 steps) with ``trainer.logger`` including ``tensorboard``: the recipe
trainer's ``_log_rollout_data`` logs each dumped step's token heatmap as a TensorBoard image at its step.

    .venv/bin/python -m pytest -q -m e2e tests/test_e2e_tracker.py      (~1.5 min on 2 cores)
"""

from __future__ import annotations

import io

import pytest

from gtpo.cpu import demo
from gtpo.viz.tracker import IMAGE_TAG
from tests.e2e_support import run_recipe, tail

pytestmark = pytest.mark.e2e


def test_trainer_logs_each_dumped_step_heatmap_to_tensorboard(ray_cluster, tmp_path):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assets = demo.build_demo_assets(tmp_path / "cache", seed=0)
    tb_dir = tmp_path / "tb"
    rollouts = tmp_path / "rollouts"
    overrides = [
        *demo.method_overrides("gtpo"),
        *demo.demo_overrides(assets, 2, 0, rollouts, method="gtpo"),
        "trainer.logger=[console,file,tensorboard]",
        # The TaskRunner is a Ray actor: the writer's folder travels in the runtime env.
        f"+ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR={tb_dir}",
    ]
    result = run_recipe(ray_cluster, tmp_path, overrides, timeout=420, name="tracker")
    assert result.returncode == 0, tail(result.log)

    acc = EventAccumulator(str(tb_dir), size_guidance={"images": 0})
    acc.Reload()
    events = acc.Images(IMAGE_TAG)
    assert [e.step for e in events] == [1, 2]  # the step each dump belongs to
    for e in events:
        img = Image.open(io.BytesIO(e.encoded_image_string))
        assert img.format == "PNG" and img.size == (e.width, e.height) and min(img.size) > 100
        assert (rollouts / "heatmaps" / f"tokens_{e.step}.advantage.html").is_file()
    assert [e.step for e in acc.Scalars("critic/score/mean")] == [1, 2]
