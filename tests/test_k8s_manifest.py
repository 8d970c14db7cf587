"""scripts/k8s/rayjob.yaml: the RayJob against KubeRay's RayJob schema (ray.io/v1), its NetworkPolicy against
Kubernetes' schema, and the fields the recipe and its security rely on.

    .venv/bin/pytest -q tests/test_k8s_manifest.py

The RayJob schemas are the CRD schemas of KubeRay v1.6.0 (the oldest release the manifest declares: "KubeRay >= 1.6",
spec.rayClusterSpec.authOptions.secretName arrived in v1.6.0) and v1.7.0; the NetworkPolicy schemas those of
Kubernetes 1.25 and 1.37 (tests/schemas/README.md gives their provenance). Both are validated with `jsonschema` in
strict mode: objects that list their properties reject unknown fields, as kubeconform -strict does, so a misspelt
field, or one the declared oldest operator does not know, fails here rather than being pruned silently by the API
server.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "scripts" / "k8s" / "rayjob.yaml"
SCHEMAS = {
    "1.6.0": REPO / "tests" / "schemas" / "rayjob_ray.io_v1_kuberay-1.6.0.schema.json",
    "1.7.0": REPO / "tests" / "schemas" / "rayjob_ray.io_v1.schema.json",
}
NETWORK_POLICY_SCHEMAS = {
    v: REPO / "tests" / "schemas" / f"networkpolicy_networking.k8s.io_v1_k8s-{v}.schema.json"
    for v in ("1.25.0", "1.37.0")
}
PLUGIN = "gtpo.verl_plugin.register"
# KubeRay's key in the token Secret (utils.RAY_AUTH_TOKEN_SECRET_KEY), read by the operator.
TOKEN_KEY = "auth_token"
# The label of ours that names the job on its pods (KubeRay's ray.io/cluster holds the generated RayCluster name).
INSTANCE = "app.kubernetes.io/instance"


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
def docs() -> list[dict]:
    return list(yaml.safe_load_all(MANIFEST.read_text()))


def only(docs: list[dict], kind: str) -> dict:
    """The one document of ``kind`` (a second one, or none, fails)."""
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.fixture(scope="module")
def job(docs) -> dict:
    return only(docs, "RayJob")


@pytest.fixture(scope="module")
def policy(docs) -> dict:
    return only(docs, "NetworkPolicy")


def errors(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_schema_valid(validator, job):
    assert errors(validator, job) == []


def test_declared_kuberay_version_is_the_oldest_schema(job):
    declared = re.search(r"KubeRay >= (\d+)\.(\d+)", MANIFEST.read_text().splitlines()[0])
    assert declared, "the manifest's first line states the oldest KubeRay it needs"
    oldest = min(SCHEMAS, key=lambda v: tuple(map(int, v.split("."))))
    assert oldest.split(".")[:2] == list(declared.groups())
    # The field that sets the floor is used (the operator's token: see the manifest's header), and the oldest schema
    # knows it.
    assert job["spec"]["rayClusterSpec"]["authOptions"]["secretName"]
    spec = json.loads(SCHEMAS[oldest].read_text())["properties"]["spec"]["properties"]
    assert "secretName" in spec["rayClusterSpec"]["properties"]["authOptions"]["properties"]


@pytest.mark.parametrize(
    "path,value",
    [
        (("spec", "shutdownAfterJobFinish"), True),  # misspelt field
        (("spec", "ttlSecondsAfterFinished"), "3600"),  # wrong type
        (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "replicas"), "4"),  # wrong type
        (("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "volumes", 0, "emptyDir", "medum"), "x"),
        (("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "containers", 0, "imagePullPolicy"), 3),
        (("spec", "rayClusterSpec", "authOptions", "mode"), "tokens"),  # not in the enum
        (("spec", "rayClusterSpec", "authOptions", "secretNme"), "gtpo-ray-auth"),  # misspelt field
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
    # The job's runtime env is readable through the dashboard's job API: no secret, no token source.
    assert "WANDB_API_KEY" not in env and not [k for k in env if k.startswith("RAY_AUTH")]

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


def test_manifest_documents(docs):
    # The NetworkPolicy first: `kubectl apply` creates it before the RayJob's pods exist. Both in one namespace (the
    # one applied to): a NetworkPolicy selects pods of its own namespace only.
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "RayJob"]
    assert len({d["metadata"].get("namespace") for d in docs}) == 1


# --- Ray's token authentication ---


def auth_containers(job) -> dict[str, tuple[dict, dict]]:
    """(container, pod spec) of every process that talks to the cluster: `ray start` on each pod, the submitter."""
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    out = {"head": (container(cluster["headGroupSpec"]), cluster["headGroupSpec"]["template"]["spec"])}
    for group in cluster["workerGroupSpecs"]:
        out[group["groupName"]] = (container(group), group["template"]["spec"])
    (submitter,) = spec["submitterPodTemplate"]["spec"]["containers"]
    out["submitter"] = (submitter, spec["submitterPodTemplate"]["spec"])
    return out


def env_of(c: dict) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def test_auth_settings_agree(job):
    """Turning token auth off (or on) is four settings: the operator's (authOptions.mode) and RAY_AUTH_MODE of head,
    workers and submitter. A mismatch breaks the job: an operator without the token polls a head that wants it."""
    modes = {"authOptions": job["spec"]["rayClusterSpec"]["authOptions"]["mode"]}
    for where, (c, _) in auth_containers(job).items():
        modes[where] = env_of(c)["RAY_AUTH_MODE"].get("value")
    assert len(set(modes.values())) == 1 and modes["authOptions"] in ("token", "disabled"), modes


def test_token_auth_reaches_head_workers_and_submitter(job):
    auth = job["spec"]["rayClusterSpec"]["authOptions"]
    assert auth["mode"] == "token" and auth["secretName"]  # on by default
    for where, (c, pod) in auth_containers(job).items():
        env = env_of(c)
        assert env["RAY_AUTH_MODE"].get("value") == "token", where
        # Set and empty: KubeRay then injects no RAY_AUTH_TOKEN valueFrom the Secret (it adds one only where the name
        # is absent), and Ray, which skips an empty RAY_AUTH_TOKEN, reads the file below.
        token = env.get("RAY_AUTH_TOKEN")
        assert token is not None and token.get("value", "") == "" and "valueFrom" not in token, where
        path = PurePosixPath(env["RAY_AUTH_TOKEN_PATH"]["value"])
        # The file comes from the Secret the operator reads, under KubeRay's key, mounted whole and read-only.
        (mount,) = [m for m in c["volumeMounts"] if path.parent == PurePosixPath(m["mountPath"])]
        assert mount.get("readOnly") is True and "subPath" not in mount, where
        volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
        secret = volume["secret"]
        assert secret["secretName"] == auth["secretName"], where
        files = {item["key"]: item["path"] for item in secret.get("items", [])} or {TOKEN_KEY: TOKEN_KEY}
        assert files.get(TOKEN_KEY) == path.name, where
        # Readable by the container's user only; a missing Secret stops the pod before Ray starts.
        assert secret.get("defaultMode", 0o644) & 0o077 == 0 and not secret.get("optional"), where


def test_no_pod_mounts_the_service_account_token(job):
    """Nothing in the pods talks to the Kubernetes API (no autoscaler): code that reaches a Ray process (TransferQueue
    unpickles what it receives) finds no API token to act on the namespace with."""
    specs = {"submitter": job["spec"]["submitterPodTemplate"]["spec"],
             "head": job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]}  # fmt: skip
    for group in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        specs[group["groupName"]] = group["template"]["spec"]
    assert {where: spec.get("automountServiceAccountToken") for where, spec in specs.items()} == dict.fromkeys(
        specs, False
    )
    assert "enableInTreeAutoscaling" not in job["spec"]["rayClusterSpec"]  # the autoscaler would need the token


def test_submitter_pod(job):
    """KubeRay uses a submitterPodTemplate as given, with its own `ray job submit` command when none is set."""
    head = container(job["spec"]["rayClusterSpec"]["headGroupSpec"])
    template = job["spec"]["submitterPodTemplate"]
    (submitter,) = template["spec"]["containers"]
    assert "command" not in submitter and "args" not in submitter
    # The CLI must match the cluster's Ray: KubeRay's default submitter takes the head's image too.
    assert submitter["image"] == head["image"]
    assert template["spec"]["restartPolicy"] == "Never"  # a Job's pods: Never or OnFailure


# --- NetworkPolicy ---


@pytest.fixture(scope="module", params=sorted(NETWORK_POLICY_SCHEMAS))
def policy_validator(request):
    schema = json.loads(NETWORK_POLICY_SCHEMAS[request.param].read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_network_policy_schema_valid(policy_validator, policy):
    assert errors(policy_validator, policy) == []


@pytest.mark.parametrize(
    "path,value",
    [
        (("spec", "podSelecter"), {}),  # misspelt field
        (("spec", "ingress", 1, "ports", 0, "prot"), "TCP"),  # misspelt field
        (("spec", "ingress", 1, "ports", 0, "port"), [8265]),  # wrong type
        (("spec", "ingress", 0, "from", 0, "podSelector", "matchLabels"), ["x"]),  # wrong type
    ],
)
def test_network_policy_schema_rejects_broken_policy(policy_validator, policy, path, value):
    broken = copy.deepcopy(policy)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert errors(policy_validator, broken)


def selects(selector: dict, labels: dict) -> bool:
    """Kubernetes' LabelSelector: matchLabels and matchExpressions, all of them; {} selects everything."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def port_admitted(port_spec: dict, port: int, named: dict) -> bool:
    if port_spec.get("protocol", "TCP") != "TCP":
        return False
    if "port" not in port_spec:
        return True
    first = named[port_spec["port"]] if isinstance(port_spec["port"], str) else port_spec["port"]
    return first <= port <= port_spec.get("endPort", first)


def admitted(policy: dict, namespace: str, src: dict, dst: dict, port: int, named: dict) -> bool | None:
    """Whether `policy`, applied in `namespace`, admits TCP from pod `src` to `port` of pod `dst` ({"ns", "labels"});
    None when it does not select `dst` (or does not restrict its ingress)."""
    spec = policy["spec"]
    if dst["ns"] != namespace or not selects(spec["podSelector"], dst["labels"]):
        return None
    if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
        return None
    for rule in spec.get("ingress") or []:
        ports = rule.get("ports") or []
        if ports and not any(port_admitted(p, port, named) for p in ports):
            continue
        peers = rule.get("from") or []
        if not peers:
            return True  # a rule without `from` admits every source
        for peer in peers:
            assert "ipBlock" not in peer, "an ipBlock admits addresses, not this job's pods"
            if "namespaceSelector" in peer:
                in_namespace = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src["ns"]})
            else:
                in_namespace = src["ns"] == namespace
            if in_namespace and selects(peer.get("podSelector", {}), src["labels"]):
                return True
    return False


def kuberay_pod(job: dict, group: dict, node_type: str, group_name: str) -> dict:
    """A Ray pod's labels as KubeRay v1.6 sets them (common/pod.go labelPod): its own, then the template's except
    ray.io/node-type, ray.io/group and ray.io/cluster. The RayCluster is named <job>-<5 random characters>."""
    cluster = f"{job['metadata']['name']}-x7k2p"
    labels = {
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": cluster,
        "ray.io/node-type": node_type,
        "ray.io/group": group_name,
        "ray.io/identifier": f"{cluster}-{node_type}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    for key, value in group["template"].get("metadata", {}).get("labels", {}).items():
        if key not in ("ray.io/node-type", "ray.io/group", "ray.io/cluster"):
            labels[key] = value
    return labels


JOB_NS = "team-a"


def network_policy_problems(policy: dict, job: dict) -> list[str]:
    """Who `policy` admits to this job's Ray pods, set against who it must: the job's own Ray pods on every port,
    the submitter and the KubeRay operator on the dashboard's port only, nobody else on any port."""
    cluster = job["spec"]["rayClusterSpec"]
    head_group, worker_group = cluster["headGroupSpec"], cluster["workerGroupSpecs"][0]
    name = job["metadata"]["name"]
    named = {p["name"]: p["containerPort"] for p in container(head_group)["ports"]}
    dashboard = named["dashboard"]
    ports = sorted({*named.values(), 52365, 8080, 12345, 20001})  # + agent, metrics, a worker's, an NCCL port

    # The head of another job from this manifest, renamed as its header says: its own label and RayCluster.
    other_head = kuberay_pod(job, head_group, "head", "headgroup")
    other_head.update(
        {INSTANCE: "other-job", "ray.io/cluster": "other-job-b9q4z", "ray.io/identifier": "other-job-b9q4z-head"}
    )

    ray_pods = {
        "head": {"ns": JOB_NS, "labels": kuberay_pod(job, head_group, "head", "headgroup")},
        "worker": {"ns": JOB_NS, "labels": kuberay_pod(job, worker_group, "worker", worker_group["groupName"])},
    }
    submitter_labels = {
        **job["spec"]["submitterPodTemplate"].get("metadata", {}).get("labels", {}),
        "batch.kubernetes.io/job-name": name,  # the submitter Job is named after the RayJob
        "job-name": name,
    }
    operator_helm = {
        "app.kubernetes.io/name": "kuberay-operator",
        "app.kubernetes.io/instance": "kuberay-operator",
        "app.kubernetes.io/component": "kuberay-operator",
    }
    operator_kustomize = {"app.kubernetes.io/name": "kuberay", "app.kubernetes.io/component": "kuberay-operator"}
    dashboard_only = {
        "submitter": {"ns": JOB_NS, "labels": submitter_labels},
        # KubeRay's default install namespace (Helm quickstart, kustomize): the manifest's as shipped.
        "operator (Helm)": {"ns": "default", "labels": operator_helm},
        "operator (kustomize)": {"ns": "default", "labels": operator_kustomize},
    }
    nobody = {
        "unlabelled pod, same namespace": {"ns": JOB_NS, "labels": {}},
        "another job's head": {"ns": JOB_NS, "labels": other_head},
        "another job's submitter": {
            "ns": JOB_NS,
            "labels": {INSTANCE: "other-job", "batch.kubernetes.io/job-name": "other-job", "job-name": "other-job"},
        },
        "operator-labelled pod, job's namespace": {"ns": JOB_NS, "labels": operator_helm},
        "operator-labelled pod, other namespace": {"ns": "team-b", "labels": operator_helm},
        "unlabelled pod, operator's namespace": {"ns": "default", "labels": {}},
    }

    problems = []
    everyone = {**ray_pods, **dashboard_only, **nobody}
    selected = sorted(
        k
        for k, pod in everyone.items()
        if admitted(policy, JOB_NS, {"ns": "x", "labels": {}}, pod, 1, named) is not None
    )
    if selected != sorted(ray_pods):
        problems.append(f"the policy isolates {selected}, not the job's Ray pods {sorted(ray_pods)}")
    for dst_name, dst in ray_pods.items():
        for src_name, src in everyone.items():
            for port in ports:
                want = src_name in ray_pods or (src_name in dashboard_only and port == dashboard)
                got = admitted(policy, JOB_NS, src, dst, port, named)
                if got is not want:
                    problems.append(f"{src_name} -> {dst_name}:{port}: {got}, want {want}")
    return problems


def test_network_policy_admits_only_the_job_and_the_operator(policy, job):
    assert network_policy_problems(policy, job) == []


def test_pods_carry_the_label_the_policy_selects(policy, job):
    """A renamed job must rename the label everywhere: the pods would otherwise be unreachable or unprotected."""
    name = job["metadata"]["name"]
    assert policy["metadata"]["name"] == name
    cluster = job["spec"]["rayClusterSpec"]
    for template in (
        cluster["headGroupSpec"]["template"],
        *(g["template"] for g in cluster["workerGroupSpecs"]),
        job["spec"]["submitterPodTemplate"],
    ):
        assert template["metadata"]["labels"][INSTANCE] == name
    assert policy["spec"]["podSelector"]["matchLabels"][INSTANCE] == name


def _remove_operator_namespace(p):
    del p["spec"]["ingress"][1]["from"][1]["namespaceSelector"]


def _any_operator_namespace(p):
    p["spec"]["ingress"][1]["from"][1]["namespaceSelector"] = {}


def _every_port_for_the_submitter(p):
    del p["spec"]["ingress"][1]["ports"]


def _submitter_among_ray_pods(p):
    del p["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["ray.io/is-ray-node"]


def _admit_all(p):
    p["spec"]["ingress"].append({})


def _select_every_pod(p):
    p["spec"]["podSelector"] = {}


def _egress_only(p):
    p["spec"]["policyTypes"] = ["Egress"]


def _other_job_label(p):
    p["spec"]["podSelector"]["matchLabels"][INSTANCE] = "gtpo-other"


@pytest.mark.parametrize(
    "breaks",
    [
        _remove_operator_namespace,
        _any_operator_namespace,
        _every_port_for_the_submitter,
        _submitter_among_ray_pods,
        _admit_all,
        _select_every_pod,
        _egress_only,
        _other_job_label,
    ],
)
def test_network_policy_check_catches(policy, job, breaks):
    broken = copy.deepcopy(policy)
    breaks(broken)
    assert network_policy_problems(broken, job)


# --- Secrets on the command line ---


def _secret_commands(text: str, prefix: str = "") -> list[str]:
    return [
        line[len(prefix) :].strip()
        for line in text.splitlines()
        if "kubectl create secret" in line and line.startswith(prefix)
    ]


def test_no_secret_from_a_literal():
    """`kubectl create secret ... --from-literal=KEY=VALUE` puts the value in the process list and the shell history."""
    files = [
        REPO / "README.md",
        *(REPO / "docs").rglob("*.md"),
        *(p for p in (REPO / "scripts").rglob("*") if p.is_file()),
    ]
    found = []
    for path in files:
        text = path.read_text(errors="replace").replace("\\\n", " ")  # one line per continued shell command
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(r"create\s+secret\b.*--from-literal", line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "use --from-file=KEY=/dev/stdin (or a file):\n" + "\n".join(found)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the documented token command uses openssl")
def test_secret_commands(job, tmp_path):
    """The manifest header's and docs/cluster.md's `kubectl create secret` lines, run under bash with a kubectl that
    records its arguments and standard input: the Secrets the manifest reads, with nothing secret in an argument
    and the token exactly as the operator sends it (no newline: Go refuses such a header value)."""
    header = _secret_commands(MANIFEST.read_text(), "#   ")
    docs = _secret_commands((REPO / "docs" / "cluster.md").read_text())
    assert header and sorted(docs) == sorted(header)

    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(
        "#!/bin/bash\n"
        f'n=$(ls {log} | wc -l); printf "%s\\n" "$@" > {log}/$n.args\n'
        f'for a in "$@"; do [[ $a == --from-file=*=/dev/stdin ]] && cat > {log}/$n.stdin; done; exit 0\n'
    )
    kubectl.chmod(0o755)
    wandb_key = "wandb-key-0123456789abcdef"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "WANDB_API_KEY": wandb_key}
    for command in header:
        subprocess.run(["bash", "-euo", "pipefail", "-c", command], env=env, check=True)

    created = {}
    for args_file in sorted(log.glob("*.args")):
        args = args_file.read_text().splitlines()
        assert args[:3] == ["create", "secret", "generic"], args
        (source,) = [a for a in args if a.startswith("--from-file=")]
        key, _, path = source.removeprefix("--from-file=").partition("=")
        assert path == "/dev/stdin", args
        created[(args[3], key)] = (args, args_file.with_suffix(".stdin").read_text())

    auth = job["spec"]["rayClusterSpec"]["authOptions"]
    (token_args, token) = created.pop((auth["secretName"], TOKEN_KEY))
    assert re.fullmatch(r"[0-9a-f]{64}", token), repr(token)  # 32 random bytes, hex, no newline
    refs = {
        (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for c, _ in auth_containers(job).values()
        for e in c.get("env", [])
        if e["name"] == "WANDB_API_KEY"
    }
    (wandb_ref,) = refs
    (wandb_args, stored_key) = created.pop(wandb_ref)
    assert stored_key == wandb_key
    assert not created, created
    for args in (token_args, wandb_args):
        assert not [a for a in args if token in a or wandb_key in a], args


# --- The 7B variant: scripts/k8s-7b, a kustomize overlay of rayjob.yaml (`kubectl apply -k scripts/k8s-7b`) ---

OVERLAY_7B = REPO / "scripts" / "k8s-7b"
# The kustomization fields render() implements; any other (namePrefix, labels, images, ...) must be added to it first.
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches"}
# What the 7B job may change in the 32B one (JSON pointers); the runtime env is compared variable by variable.
CHANGED_7B = {
    "NetworkPolicy": {
        "/metadata/name",
        "/spec/podSelector/matchLabels/app.kubernetes.io~1instance",
        "/spec/ingress/0/from/0/podSelector/matchLabels/app.kubernetes.io~1instance",
        "/spec/ingress/1/from/0/podSelector/matchLabels/app.kubernetes.io~1instance",
    },
    "RayJob": {
        "/metadata/name",
        "/spec/entrypoint",
        "/spec/runtimeEnvYAML",
        "/spec/submitterPodTemplate/metadata/labels/app.kubernetes.io~1instance",
        "/spec/rayClusterSpec/headGroupSpec/template/metadata/labels/app.kubernetes.io~1instance",
        "/spec/rayClusterSpec/workerGroupSpecs/0/replicas",
        "/spec/rayClusterSpec/workerGroupSpecs/0/minReplicas",
        "/spec/rayClusterSpec/workerGroupSpecs/0/maxReplicas",
        "/spec/rayClusterSpec/workerGroupSpecs/0/template/metadata/labels/app.kubernetes.io~1instance",
        "/spec/rayClusterSpec/workerGroupSpecs/0/template/spec/containers/0/resources/requests/memory",
        "/spec/rayClusterSpec/workerGroupSpecs/0/template/spec/containers/0/resources/limits/memory",
    },
}
CHANGED_7B_ENV = {
    "NNODES", "MODEL_PATH", "CKPTS_DIR", "VERL_FILE_LOGGER_ROOT", "TENSORBOARD_DIR", "WANDB_DIR", "EXP_NAME"
}  # fmt: skip


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [token.replace("~1", "/").replace("~0", "~") for token in path[1:].split("/")]


def _step(node, token: str):
    if isinstance(node, list):
        return node[int(token)]  # IndexError past the end, as a patch on a missing item fails
    return node[token]  # KeyError


def json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 on ``doc`` in place, as kustomize applies it: replace, remove and test need their path; add appends
    with ``-``; a failed test raises."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        for token in parents:
            node = _step(node, token)
        kind = op["op"]
        if kind == "test":
            assert _step(node, last) == op["value"], f"test {op['path']}: {_step(node, last)!r} != {op['value']!r}"
        elif kind == "replace":
            _step(node, last)
            node[int(last) if isinstance(node, list) else last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            _step(node, last)
            del node[int(last) if isinstance(node, list) else last]
        elif kind == "add":
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                node[last] = copy.deepcopy(op["value"])
        else:
            raise AssertionError(f"op {kind!r} not implemented here")


def render(folder: Path) -> list[dict]:
    """``kubectl kustomize folder`` for what the recipe's kustomizations use: resources (files, or folders with a
    kustomization of their own), then each JSON patch on the one resource its target names."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert kustomization.get("kind", "Kustomization") == "Kustomization", kustomization
    assert set(kustomization) <= KUSTOMIZATION_FIELDS, kustomization
    docs = []
    for resource in kustomization.get("resources", []):
        path = (folder / resource).resolve()
        docs += render(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
    for patch in kustomization.get("patches", []):
        text = (folder / patch["path"]).read_text() if "path" in patch else patch["patch"]
        ops = yaml.safe_load(text)
        assert isinstance(ops, list), "JSON patches only: kustomize merges a custom resource's lists whole"
        target = patch["target"]
        (doc,) = [
            d
            for d in docs
            if d["kind"] == target["kind"]
            and d["metadata"]["name"] == target.get("name", d["metadata"]["name"])
            and (d["apiVersion"].rpartition("/")[0] == target.get("group", d["apiVersion"].rpartition("/")[0]))
        ]
        json_patch(doc, ops)
    return docs


@pytest.fixture(scope="module")
def docs_7b() -> list[dict]:
    return render(OVERLAY_7B)


@pytest.fixture(scope="module")
def job_7b(docs_7b) -> dict:
    return only(docs_7b, "RayJob")


@pytest.fixture(scope="module")
def policy_7b(docs_7b) -> dict:
    return only(docs_7b, "NetworkPolicy")


def test_render_is_what_kubectl_builds(docs, docs_7b):
    """The rendering here against kubectl's own kustomize, where kubectl is installed (it needs no cluster)."""
    assert render(REPO / "scripts" / "k8s") == docs  # the base adds nothing to rayjob.yaml
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlay is checked through render() alone")
    for folder, want in ((OVERLAY_7B, docs_7b), (REPO / "scripts" / "k8s", docs)):
        built = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
        assert built.returncode == 0, built.stderr
        assert list(yaml.safe_load_all(built.stdout)) == want, folder


def test_json_patch_fails_as_kustomize_does():
    doc = {"spec": {"groups": [{"name": "gpu-workers", "replicas": 4}]}}
    with pytest.raises(KeyError):
        json_patch(copy.deepcopy(doc), [{"op": "replace", "path": "/spec/group", "value": 1}])
    with pytest.raises(IndexError):
        json_patch(copy.deepcopy(doc), [{"op": "replace", "path": "/spec/groups/1/replicas", "value": 1}])
    with pytest.raises(AssertionError):
        json_patch(copy.deepcopy(doc), [{"op": "test", "path": "/spec/groups/0/name", "value": "cpu"}])
    json_patch(doc, [{"op": "replace", "path": "/spec/groups/0/replicas", "value": 1}])
    assert doc == {"spec": {"groups": [{"name": "gpu-workers", "replicas": 1}]}}


def test_7b_schema_valid(validator, job_7b):
    assert errors(validator, job_7b) == []


def test_7b_network_policy_schema_valid(policy_validator, policy_7b):
    assert errors(policy_validator, policy_7b) == []


def test_7b_asks_one_worker_of_8_gpus_and_runs_the_7b_launcher(job_7b):
    spec = job_7b["spec"]
    (workers,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 1
    resources = container(workers)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "8"
    launchers = re.findall(r"/workspace/gtpo/(scripts/run_\w+_qwen2\.5_\w+\.sh)", spec["entrypoint"])
    assert launchers == ["scripts/run_gtpo_qwen2.5_7b.sh"], spec["entrypoint"]
    assert " gtpo qwen2.5_7b " in (REPO / launchers[0]).read_text()  # the wrapper hands run.sh its method and model
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    # the 7B preset's cluster shape (configs/model/qwen2.5_7b.yaml) is the job's
    preset = yaml.safe_load((REPO / "configs" / "model" / "qwen2.5_7b.yaml").read_text())["trainer"]
    assert (int(env["NNODES"]), int(env["NGPUS_PER_NODE"])) == (preset["nnodes"], preset["n_gpus_per_node"]) == (1, 8)
    assert env["MODEL_PATH"].endswith("/Qwen2.5-7B") and env["EXP_NAME"] == "gtpo-qwen2.5-7b"
    assert env["CKPTS_DIR"].endswith("/gtpo-qwen2.5-7b") and job_7b["metadata"]["name"] == "gtpo-qwen2-5-7b"


def _differences(a, b, path: str = "") -> set[str]:
    """JSON pointers where ``a`` and ``b`` differ (leaves, or a key or item present in one only)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) | set(b)
        esc = {k: str(k).replace("~", "~0").replace("/", "~1") for k in keys}
        return {p for k in keys for p in _differences(a.get(k, KeyError), b.get(k, KeyError), f"{path}/{esc[k]}")}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return {p for i, (x, y) in enumerate(zip(a, b)) for p in _differences(x, y, f"{path}/{i}")}
    return set() if a == b else {path}


def test_7b_differs_from_32b_only_where_named(docs, docs_7b):
    """Token auth, Secret mounts, preStop hooks, grace periods, images, volumes: the 32B job's, whatever changes there
    (a runtime env variable added to rayjob.yaml must be added to scripts/k8s-7b/rayjob.patch.yaml too)."""
    assert [d["kind"] for d in docs_7b] == [d["kind"] for d in docs]
    for base, variant in zip(docs, docs_7b):
        assert _differences(base, variant) == CHANGED_7B[base["kind"]], base["kind"]
    job, job_7b = only(docs, "RayJob"), only(docs_7b, "RayJob")
    env, env_7b = (yaml.safe_load(j["spec"]["runtimeEnvYAML"])["env_vars"] for j in (job, job_7b))
    assert set(env) == set(env_7b), set(env) ^ set(env_7b)
    assert {k for k in env if env[k] != env_7b[k]} == CHANGED_7B_ENV
    assert job_7b["spec"]["entrypoint"] == job["spec"]["entrypoint"].replace("qwen2.5_32b", "qwen2.5_7b")


@pytest.mark.parametrize(
    "check",
    [
        test_recipe_fields,
        test_entrypoint_keeps_the_paper_run_length,
        test_multi_node_network_and_cpus,
        test_metric_logs_go_to_the_checkpoint_volume,
        test_ray_version_matches_image,
        test_auth_settings_agree,
        test_token_auth_reaches_head_workers_and_submitter,
        test_submitter_pod,
        test_no_pod_mounts_the_service_account_token,
    ],
    ids=lambda check: check.__name__.removeprefix("test_"),
)
def test_7b_job_passes_the_32b_job_checks(job_7b, check):
    check(job_7b)


def test_7b_network_policy_selects_and_admits_the_7b_job(docs_7b, policy_7b, job_7b, policy):
    test_manifest_documents(docs_7b)
    test_pods_carry_the_label_the_policy_selects(policy_7b, job_7b)
    assert network_policy_problems(policy_7b, job_7b) == []
    # the 32B job's policy, unpatched, would leave the 7B job's pods open to every pod of the namespace
    assert network_policy_problems(policy, job_7b)


def doc_kustomizations() -> dict[str, str]:
    """docs/cluster.md's kustomizations of one's own: ``{folder under runs/: text}`` of each `cat > ... <<'EOF'`."""
    text = (REPO / "docs" / "cluster.md").read_text()
    found = re.findall(r"cat > (runs/[\w-]+)/kustomization\.yaml <<'EOF'\n(.*?)\nEOF\n", text, re.S)
    return dict(found)


def test_the_guides_smoke_and_evaluation_jobs(tmp_path, validator, docs_7b):
    """docs/cluster.md's smoke and evaluation RayJobs, written where the guide writes them (runs/ in the checkout)
    and built as kubectl would: valid, the 7B job's pods and token, running what they say, and everything they own
    renamed (a NetworkPolicy of their own that selects and admits only their pods, never the 7B job's)."""
    found = doc_kustomizations()
    assert set(found) == {"runs/k8s-smoke", "runs/k8s-eval"}, sorted(found)
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    for folder, text in found.items():
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "kustomization.yaml").write_text(text + "\n")
        docs = render(tmp_path / folder)
        policy_doc, job = only(docs, "NetworkPolicy"), only(docs, "RayJob")
        name = job["metadata"]["name"]
        assert errors(validator, job) == [] and name == f"gtpo-{folder.rpartition('-')[2]}"
        assert policy_doc["metadata"]["name"] == name
        instances = re.findall(r"app\.kubernetes\.io/instance: (\S+)", yaml.safe_dump_all(docs, sort_keys=False))
        assert instances and set(instances) == {name}, instances
        assert network_policy_problems(policy_doc, job) == []
        assert network_policy_problems(docs_7b[0], job), "the 7B job's policy would select the renamed pods"
        test_token_auth_reaches_head_workers_and_submitter(job)
        env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
        entrypoint = job["spec"]["entrypoint"]
        scripts = re.findall(r"/workspace/gtpo/(scripts/\S+\.sh)", entrypoint)
        assert scripts and all((REPO / s).is_file() for s in scripts), entrypoint
        if folder.endswith("smoke"):
            assert scripts == ["scripts/run_smoke_qwen2.5_0.5b.sh"]
            # the 7B job's names and log folders are unset: the smoke run's own go under its CKPTS_DIR
            unset = set(re.findall(r"-u (\w+)", entrypoint))
            assert unset == {"PROJECT_NAME", "EXP_NAME", "VERL_FILE_LOGGER_ROOT", "TENSORBOARD_DIR", "WANDB_DIR",
                             "NNODES", "NGPUS_PER_NODE"}  # fmt: skip
            assert {"NNODES", "NGPUS_PER_NODE"} <= set(env)  # one GPU, the smoke preset's, as everywhere
            assert unset <= set(env) and "MODEL_PATH=/data/models/Qwen2.5-0.5B-Instruct" in entrypoint
        else:
            assert scripts == ["scripts/eval_checkpoint.sh", "scripts/run_gtpo_qwen2.5_7b.sh"]
            assert f"{env['CKPTS_DIR']}/global_step_" in entrypoint  # a checkpoint of the 7B job's folder
        kubectl = shutil.which("kubectl")
        if kubectl:
            built = subprocess.run([kubectl, "kustomize", str(tmp_path / folder)], capture_output=True, text=True)
            assert built.returncode == 0 and list(yaml.safe_load_all(built.stdout)) == docs, built.stderr
