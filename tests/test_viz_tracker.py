"""The token heatmap in the tracker: verl's own ``Tracking`` object with TensorBoard and W&B (offline), read back.

Run: ``.venv/bin/pytest -q tests/test_viz_tracker.py``  (no Ray; W&B runs with ``WANDB_MODE=offline``)
"""

from __future__ import annotations

import glob
import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from gtpo.viz import tracker
from gtpo.viz.dump_writer import token_records
from gtpo.viz.tracker import HTML_TAG, IMAGE_TAG, log_token_heatmap, tracker_responses, wants_heatmap

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _records(step: int) -> list[dict]:
    texts = ["42 is it", "41?", "x"]
    ids = np.zeros((3, 8), dtype=np.int64)
    mask = np.zeros((3, 8), dtype=np.int64)
    for r, t in enumerate(texts):
        ids[r, : len(t)] = list(t.encode())
        mask[r, : len(t)] = 1
    adv = np.where(mask, np.linspace(-1, 1, 8)[None, :] * (step + 1), 0.0)
    return token_records(
        step=step,
        uids=["u0", "u0", "u1"],
        responses=ids,
        response_mask=mask,
        tokenizer=ByteTokenizer(),
        advantages=adv,
        entropy=np.where(mask, 0.5, 0.0),
        scores=np.array([1.0, 0.0, 1.0]),
        prompts=["What is 6*7?", "What is 6*7?", "Say x"],
    )


def _tracking(backends, tmp_path, monkeypatch):
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    return Tracking(project_name="proj", experiment_name="exp", default_backend=backends, config={"trainer": {}})


def test_tensorboard_gets_the_image_at_its_step(tmp_path, monkeypatch):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracking = _tracking(["console", "tensorboard"], tmp_path, monkeypatch)
    assert wants_heatmap(tracking) == ["tensorboard"]
    written = {}
    for step in (3, 5):  # verl's order: the heatmap, then the step's metrics, at the same step
        written[step] = log_token_heatmap(tracking, _records(step), step, tmp_path / "heatmaps")
        tracking.log({"critic/score/mean": 0.5}, step=step)
    tracking.finish()

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    assert IMAGE_TAG in acc.Tags()["images"]
    events = acc.Images(IMAGE_TAG)
    assert [e.step for e in events] == [3, 5]
    for event in events:
        png = written[event.step]["png"]
        img = Image.open(io.BytesIO(event.encoded_image_string))
        assert img.format == "PNG" and (img.width, img.height) == (event.width, event.height)
        on_disk = (imread(png)[..., :3] * 255).round().astype(np.uint8)
        assert np.array_equal(np.asarray(img.convert("RGB")), on_disk)  # the very picture, decodable
    assert Path(written[3]["png"]).name == "tokens_3.advantage.png" and written[3]["backends"] == "tensorboard"
    (text_tag,) = [t for t in acc.Tags()["tensors"] if t.startswith(HTML_TAG)]  # torch appends /text_summary
    texts = acc.Tensors(text_tag)
    assert [t.step for t in texts] == [3, 5]
    assert written[5]["html"] in texts[1].tensor_proto.string_val[0].decode()
    assert [e.step for e in acc.Scalars("critic/score/mean")] == [3, 5]


def _wandb_history(run_dir: Path) -> list[tuple[int, dict[str, object]]]:
    """``[(step, {key: value})]`` from an offline run's ``run-<id>.wandb`` (W&B's 32 KiB-block record log)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks, parts = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # full record
            chunks.append(chunk)
        elif kind in (2, 3):  # first, middle
            parts += chunk
        elif kind == 4:  # last
            chunks.append(parts + chunk)
            parts = b""
    history = []
    for chunk in chunks:
        rec = pb.Record()
        rec.ParseFromString(chunk)
        if rec.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            history.append((rec.history.step.num, items))
    return history


def test_wandb_offline_gets_image_and_html_at_its_step(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    tracking = _tracking(["console", "wandb"], tmp_path, monkeypatch)
    assert wants_heatmap(tracking) == ["wandb"]
    tracking.log({"critic/score/mean": 0.1}, step=1)
    written = log_token_heatmap(tracking, _records(2), 2, tmp_path / "heatmaps")
    tracking.log({"critic/score/mean": 0.2}, step=2)
    monkeypatch.setattr(tracker, "WANDB_MAX_HTML_BYTES", 100)  # a page too large to upload: a note instead
    log_token_heatmap(tracking, _records(3), 3, tmp_path / "heatmaps")
    tracking.finish()
    wandb.teardown()  # waits for W&B's service process, which writes the run file after finish() returns
    assert written["backends"] == "wandb"

    run_dir = Path(glob.glob(str(tmp_path / "wandb" / "offline-run-*"))[0])
    history = dict(_wandb_history(run_dir))
    assert set(history) == {1, 2, 3}
    row = history[2]  # the heatmap and the step's metrics share one row
    assert row["critic/score/mean"] == 0.2
    assert row[f"{IMAGE_TAG}/_type"] == "image-file" and row[f"{HTML_TAG}/_type"] == "html-file"
    image = run_dir / "files" / row[f"{IMAGE_TAG}/path"]
    assert image.read_bytes()[:8] == PNG_MAGIC
    assert (
        imread(image).shape[:2]
        == imread(written["png"]).shape[:2]
        == (row[f"{IMAGE_TAG}/height"], row[f"{IMAGE_TAG}/width"])
    )
    page = (run_dir / "files" / row[f"{HTML_TAG}/path"]).read_text(encoding="utf-8")
    assert page == Path(written["html"]).read_text(encoding="utf-8")  # passed through unchanged
    assert "What is 6*7?" in page
    note = (run_dir / "files" / history[3][f"{HTML_TAG}/path"]).read_text(encoding="utf-8")
    assert "too large to upload" in note and "tokens_3.advantage.html" in note


def test_no_image_backend_no_rendering(tmp_path, monkeypatch):
    tracking = _tracking(["console", "file"], tmp_path, monkeypatch)
    assert wants_heatmap(tracking) == []
    assert log_token_heatmap(tracking, _records(1), 1, tmp_path / "heatmaps") == {}
    assert not (tmp_path / "heatmaps").exists()
    tracking.finish()


def test_a_failure_warns_and_never_raises(tmp_path, caplog):
    class Broken:
        def add_image(self, *a, **k):
            raise OSError("disk full")

    class Adapter:
        writer = Broken()

    class FakeTracking:
        logger = {"tensorboard": Adapter()}

    with caplog.at_level("WARNING", logger="gtpo.viz.tracker"):
        assert log_token_heatmap(FakeTracking(), _records(4), 4, tmp_path) == {}
    assert "step 4" in caplog.text and "disk full" in caplog.text


def test_tracker_shows_what_its_png_shows():
    from gtpo.viz.dump_reader import Response

    rs = [
        Response(uid=f"g{g}", tokens=["x"], key=f"g{g}_{i}", correct=(i % 2 == 0)) for g in range(6) for i in range(10)
    ]
    shown = tracker_responses(rs, max_prompts=tracker.TRACKER_MAX_PROMPTS)
    per = 2 * tracker.TRACKER_RESPONSES_PER_COLUMN
    assert [r.uid for r in shown] == [f"g{g}" for g in range(tracker.TRACKER_MAX_PROMPTS) for _ in range(per)]
    assert [r.key for r in shown[:4]] == ["g0_0", "g0_2", "g0_1", "g0_3"]  # correct first, then incorrect
