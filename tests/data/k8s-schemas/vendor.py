#!/usr/bin/env python3
"""Writes the schemas in this directory from their upstream files (see README.md).

    vendor.py KUBERNETES_VALIDATE_WHEEL TRAINING_OPERATOR_CRD_YAML

Reduces them and changes nothing else: descriptions dropped, and of Kubernetes' shared
definitions only those the vendored kinds reach. The rules that make the check strict are
applied by tests/tests/k8s.rs when it loads them, so these files stay what upstream says.
"""

import json
import re
import sys
import zipfile
from pathlib import Path

import yaml

KUBERNETES = "v1.31.0"
TRAINING_OPERATOR = "v1.9.0"
# The kinds k8s/ uses, as kubernetes-validate names their files.
KINDS = ["service-v1", "deployment-apps-v1", "statefulset-apps-v1"]
# Reached by the test itself: a custom resource's metadata, and the pods the training
# operator makes from a PyTorchJob's templates.
EXTRA_DEFS = [
    "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
    "io.k8s.api.core.v1.PodTemplateSpec",
]
HERE = Path(__file__).resolve().parent


def strip_descriptions(schema):
    """Drops the `description` keyword everywhere, but not a property named description."""
    if isinstance(schema, list):
        return [strip_descriptions(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key in ("properties", "$defs", "patternProperties"):
            out[key] = {name: strip_descriptions(s) for name, s in value.items()}
        else:
            out[key] = strip_descriptions(value)
    return out


def refs(schema):
    """The names of the shared definitions a schema refers to."""
    return set(re.findall(r'"\$ref": "[^"]*#/\$defs/([^"]+)"', json.dumps(schema)))


def write(path, schema):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print(f"{path.relative_to(HERE)}: {path.stat().st_size} bytes")


def kubernetes(wheel):
    prefix = f"kubernetes_validate/kubernetes-json-schema/{KUBERNETES}-local-strict/"
    out = HERE / f"kubernetes-{KUBERNETES}-strict"
    with zipfile.ZipFile(wheel) as z:
        defs = json.loads(z.read(prefix + "_definitions.json"))
        kinds = {k: json.loads(z.read(f"{prefix}{k}.json")) for k in KINDS}
    wanted = set(EXTRA_DEFS)
    for schema in kinds.values():
        wanted |= refs(schema)
    todo = list(wanted)
    while todo:
        for name in refs(defs["$defs"][todo.pop()]) - wanted:
            wanted.add(name)
            todo.append(name)
    defs["$defs"] = {n: s for n, s in defs["$defs"].items() if n in wanted}
    write(out / "_definitions.json", strip_descriptions(defs))
    for name, schema in kinds.items():
        write(out / f"{name}.json", strip_descriptions(schema))


def pytorchjob(crd_path):
    crd = yaml.safe_load(Path(crd_path).read_text())
    assert crd["spec"]["names"]["kind"] == "PyTorchJob", crd_path
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strip_descriptions(version["schema"]["openAPIV3Schema"])
    out = HERE / f"kubeflow-training-operator-{TRAINING_OPERATOR}"
    write(out / "pytorchjob-kubeflow.org-v1.json", schema)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    kubernetes(sys.argv[1])
    pytorchjob(sys.argv[2])
