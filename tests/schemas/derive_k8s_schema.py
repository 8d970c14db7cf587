"""Derive a self-contained Kubernetes JSON schema (e.g. NetworkPolicy) from kubernetes-validate's bundled schemas.

    python tests/schemas/derive_k8s_schema.py <kubernetes-json-schema>/v1.25.0-local-strict \
        networkpolicy-networking-v1.json > tests/schemas/networkpolicy_networking.k8s.io_v1_k8s-1.25.0.schema.json

Input: one version folder of the ``kubernetes-json-schema`` tree inside the PyPI wheel ``kubernetes-validate`` (see
README.md beside this file for the exact release) and the name of a kind's file in it. That file refers to
``/api/_definitions.json#/$defs/<name>``, and the definitions to each other as ``#/$defs/<name>``. Output: the kind's
schema with exactly the definitions it reaches copied under ``$defs``, every reference made local, every
``description`` annotation removed, ``$id`` dropped (nothing else changed), as compact JSON with sorted keys.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_PREFIXES = ("/api/_definitions.json#/$defs/", "#/$defs/")
# Keywords whose values map names (of properties or definitions) to schemas: a key "description" there is a name.
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _target(ref: str) -> str:
    for prefix in _PREFIXES:
        if ref.startswith(prefix):
            return ref[len(prefix) :]
    raise ValueError(f"unexpected $ref {ref!r}")


def _rewrite(node, reached: list[str]):
    """``node`` with local references and no descriptions; names of the definitions it refers to go into ``reached``."""
    if isinstance(node, list):
        return [_rewrite(item, reached) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("description", "$id"):
            continue
        if key == "$ref":
            name = _target(value)
            reached.append(name)
            out[key] = "#/$defs/" + name
        elif key in _NAME_MAPS and isinstance(value, dict):
            out[key] = {name: _rewrite(schema, reached) for name, schema in value.items()}
        else:
            out[key] = _rewrite(value, reached)
    return out


def derive(folder: str | Path, kind_file: str) -> dict:
    folder = Path(folder)
    definitions = json.loads((folder / "_definitions.json").read_text())["$defs"]
    todo: list[str] = []
    schema = _rewrite(json.loads((folder / kind_file).read_text()), todo)
    defs = {}
    while todo:
        name = todo.pop()
        if name not in defs:
            defs[name] = _rewrite(definitions[name], todo)
    schema["$defs"] = defs
    return schema


def main(folder: str, kind_file: str) -> None:
    json.dump(derive(folder, kind_file), sys.stdout, separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
