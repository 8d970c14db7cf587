"""Derive tests/schemas/rayjob_ray.io_v1.schema.json from KubeRay's RayJob CustomResourceDefinition.

    python tests/schemas/derive_rayjob_schema.py ray.io_rayjobs.yaml > tests/schemas/rayjob_ray.io_v1.schema.json

Input: ``ray-operator/config/crd/bases/ray.io_rayjobs.yaml`` of ray-project/kuberay (see README.md beside this file
for the exact release). Output: the ``openAPIV3Schema`` of the served ``v1`` version, with every ``description``
removed (they are ~80% of the file) and nothing else changed, as compact JSON with sorted keys.
"""

from __future__ import annotations

import json
import sys

import yaml


def strip_descriptions(node):
    if isinstance(node, dict):
        return {key: strip_descriptions(value) for key, value in node.items() if key != "description"}
    if isinstance(node, list):
        return [strip_descriptions(item) for item in node]
    return node


def main(path: str) -> None:
    with open(path) as f:
        crd = yaml.safe_load(f)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strip_descriptions(version["schema"]["openAPIV3Schema"])
    json.dump(schema, sys.stdout, separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
