"""scripts/k8s/rayjob.yaml against KubeRay's RayJob schema (ray.io/v1), plus the fields the recipe relies on.

    .venv/bin/pytest -q tests/test_k8s_manifest.py

The schemas are the RayJob CRD schemas of KubeRay v1.2.2 (the oldest release the manifest declares: "KubeRay >=
1.2", spec.backoffLimit arrived in v1.2.0) and v1.7.0 (tests/schemas/README.md gives their provenance), validated
with `jsonschema` in strict mode: objects that list their properties reject unknown fields, as kubeconform -strict
does, so a misspelt field, or one the declared oldest operator does not know, fails here rather than being pruned
silently by the API server.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "scripts" / "k8s" / "rayjob.yaml"
SCHEMAS = {
    "1.2.2": REPO / "tests" / "schemas" / "rayjob_ray.io_v1_kuberay-1.2.2.schema.json",
    "1.7.0": REPO / "tests" / "schemas" / "rayjob_ray.io_v1.schema.json",
}
PLUGIN = "gtpo.verl_plugin.register"


def strict(schema):
    """Close every object schema that lists properties and allows nothing else explicitly."""
    if isinstance(schema, dict):
        out = {key: strict(value) for key, value in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@pytest.fixture(scope="module", params=sorted(SCHEMAS))
def validator(request):
    schema = strict(json.loads(SCHEMAS[request.param].read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def job() -> dict:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert len(docs) == 1
    return docs[0]


def errors(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_schema_valid(validator, job):
    assert errors(validator, job) == []


def test_declared_kuberay_version_is_the_oldest_schema(job):
    declared = re.search(r"KubeRay >= (\d+)\.(\d+)", MANIFEST.read_text().splitlines()[0])
    assert declared, "the manifest's first line states the oldest KubeRay it needs"
    oldest = min(SCHEMAS, key=lambda v: tuple(map(int, v.split("."))))
    assert oldest.split(".")[:2] == list(declared.groups())
    # The field that sets the floor is used, and the oldest schema knows it.
    assert "backoffLimit" in job["spec"]
    spec = json.loads(SCHEMAS[oldest].read_text())["properties"]["spec"]["properties"]
    assert "backoffLimit" in spec


@pytest.mark.parametrize(
    "path,value",
    [
        (("spec", "shutdownAfterJobFinish"), True),  # misspelt field
        (("spec", "ttlSecondsAfterFinished"), "3600"),  # wrong type
        (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "replicas"), "4"),  # wrong type
        (("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "volumes", 0, "emptyDir", "medum"), "x"),
        (("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "containers", 0, "imagePullPolicy"), 3),
    ],
)
def test_schema_rejects_broken_manifest(validator, job, path, value):
    broken = copy.deepcopy(job)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert errors(validator, broken)


def container(group: dict) -> dict:
    (c,) = group["template"]["spec"]["containers"]
    return c


def volumes_by_name(group: dict) -> dict:
    return {v["name"]: v for v in group["template"]["spec"]["volumes"]}


def mounts_by_path(group: dict) -> dict:
    return {m["mountPath"]: m for m in container(group)["volumeMounts"]}


def test_recipe_fields(job):
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0

    # The entrypoint calls launch scripts of this repository, at their path inside the image.
    scripts = re.findall(r"/workspace/gtpo/(scripts/run_\w+_qwen2\.5_\w+\.sh)", spec["entrypoint"])
    assert scripts and all((REPO / s).is_file() for s in scripts), spec["entrypoint"]

    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert PLUGIN in env["VERL_USE_EXTERNAL_MODULES"].split(",")
    # The driver adds the plugin to ray.init's runtime env too: Ray must let it win instead of failing the job.
    assert env["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"
    assert "WANDB_API_KEY" not in env

    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    (workers,) = cluster["workerGroupSpecs"]

    # GPU-less head.
    assert head["rayStartParams"]["num-gpus"] == "0"
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in container(head)["resources"].get(section, {})

    # GPU workers: fixed size, matching the launch script's node and GPU counts.
    gpus = container(workers)["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) == int(env["NGPUS_PER_NODE"]) > 0
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == int(env["NNODES"])
    assert container(head)["image"] == container(workers)["image"]

    for group in (head, workers):
        volumes, mounts = volumes_by_name(group), mounts_by_path(group)
        # Large shared memory for NCCL / vLLM.
        shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"].endswith("Gi")
        # Checkpoints on a persistent volume that holds CKPTS_DIR; data and model read from a mounted volume.
        ckpt_mount = next(p for p in mounts if env["CKPTS_DIR"].startswith(p + "/"))
        assert "persistentVolumeClaim" in volumes[mounts[ckpt_mount]["name"]]
        # TEST_FILE is a Hydra list of files, like the launch scripts' default.
        paths = [env["MODEL_PATH"], env["TRAIN_FILE"], *env["TEST_FILE"].strip("[]").split(",")]
        for path in paths:
            assert any(path.startswith(p + "/") for p in mounts), path
        # W&B key from a Secret, never a literal.
        (wandb,) = [e for e in container(group)["env"] if e["name"] == "WANDB_API_KEY"]
        assert "value" not in wandb and wandb["valueFrom"]["secretKeyRef"]["name"]


@pytest.mark.parametrize("preflight_rc", [0, 1])
def test_entrypoint_runs_preflight_then_training(job, tmp_path, preflight_rc):
    """The entrypoint under bash, with the image's launch script replaced by one that records its calls."""
    import subprocess

    fake = tmp_path / "scripts" / "run_gtpo_qwen2.5_32b.sh"
    fake.parent.mkdir()
    log = tmp_path / "calls"
    fake.write_text(
        f'echo "PREFLIGHT=$PREFLIGHT $*" >> {log}\nif [[ "$PREFLIGHT" == 1 ]]; then exit {preflight_rc}; fi\n'
    )
    entrypoint = job["spec"]["entrypoint"].replace("/workspace/gtpo/", f"{tmp_path}/")
    proc = subprocess.run(["bash", "-c", entrypoint], capture_output=True, text=True)
    calls = log.read_text().splitlines()
    preflight, training = "PREFLIGHT=1 ", "PREFLIGHT=0 "
    if preflight_rc == 0:
        assert proc.returncode == 0 and calls == [preflight, training]
    else:
        assert proc.returncode != 0 and calls == [preflight]


def test_entrypoint_keeps_the_paper_run_length(job):
    """No run-length override: trainer.total_epochs=1 would stop verl at 17,290 // 128 = 135 of paper A's 210 steps."""
    entrypoint = job["spec"]["entrypoint"]
    assert "total_epochs" not in entrypoint and "total_training_steps" not in entrypoint, entrypoint
    paper = yaml.safe_load((REPO / "configs" / "scale" / "paper.yaml").read_text())
    assert paper["trainer"]["total_training_steps"] == 210


def test_multi_node_network_and_cpus(job):
    cluster = job["spec"]["rayClusterSpec"]
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    # Set on every launch path (job runtime env, sbatch, image): NCCL frees buffers without record_stream.
    assert env["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    (workers,) = cluster["workerGroupSpecs"]
    worker = container(workers)
    assert "IPC_LOCK" in worker["securityContext"]["capabilities"]["add"]
    pod_env = {e["name"]: e.get("value") for e in worker["env"]}
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert re.fullmatch(r"[\w.-]+", pod_env[key]), key  # one interface name (Gloo rejects ^ lists)
    # Ray advertises what the pod requests; the request fits a 96-vCPU 8-GPU node's allocatable CPUs.
    cpus = int(worker["resources"]["requests"]["cpu"])
    assert int(workers["rayStartParams"]["num-cpus"]) == cpus <= 90
    assert int(worker["resources"].get("limits", {}).get("cpu", cpus)) >= cpus


def test_metric_logs_go_to_the_checkpoint_volume(job):
    """The TaskRunner may start on any pod, in the image's /workspace/gtpo, deleted with the cluster: verl's relative
    log folders would be lost. The job's runtime env (every Ray process's) points them under CKPTS_DIR."""
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    ckpts = env["CKPTS_DIR"]
    assert env["VERL_FILE_LOGGER_ROOT"] == f"{ckpts}/logs"
    assert env["TENSORBOARD_DIR"] == f"{ckpts}/tensorboard"
    assert env["WANDB_DIR"] == ckpts
    cluster = job["spec"]["rayClusterSpec"]
    for group in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):
        mounts, volumes = mounts_by_path(group), volumes_by_name(group)
        mount = next(p for p in mounts if ckpts.startswith(p + "/"))
        assert not mounts[mount].get("readOnly", False)
        assert "persistentVolumeClaim" in volumes[mounts[mount]["name"]]


def test_ray_version_matches_image(job):
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    pinned = re.search(r'"ray\[default\]==([\d.]+)"', dockerfile)
    assert pinned and job["spec"]["rayClusterSpec"]["rayVersion"] == pinned.group(1)
