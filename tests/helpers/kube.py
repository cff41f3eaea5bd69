"""deploy/kubernetes offline: render a kustomization, validate its documents, and turn a pod
template into a local process the way Kubernetes and the Kubeflow operator would start it.

``kustomize build`` is not available here: :func:`render` reads the kustomization's
``resources`` (files and directories, recursively) and applies the transformers the manifests
use (``namespace``, ``labels``, ``images``, inline JSON ``patches``).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

from helpers.crd_schemas import SCHEMAS

K8S_VERSION = "1.33"


def load_docs(path: Path) -> List[Dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _walk(node: Any) -> Iterator[Dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def containers(doc: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every container and init container, at any depth (pod templates of any kind)."""
    return [c for d in _walk(doc) for key in ("containers", "initContainers") for c in d.get(key, [])
            if isinstance(d.get(key), list)]


def _patch(doc: Dict[str, Any], ops: List[Dict[str, Any]]) -> None:
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].strip("/").split("/")]
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        key: Any = int(last) if isinstance(node, list) else last
        if op["op"] in ("replace", "add"):
            if op["op"] == "replace":
                node[key]  # must exist
            node[key] = op["value"]
        else:
            raise AssertionError(f"patch op {op['op']} not supported by this renderer")


def render(directory: Path) -> List[Dict[str, Any]]:
    """The documents ``kustomize build directory`` would print (for the features used here)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization", directory
    docs: List[Dict[str, Any]] = []
    for res in kust.get("resources", []):
        path = (directory / res).resolve()
        docs += render(path) if path.is_dir() else load_docs(path)
    docs = copy.deepcopy(docs)
    for doc in docs:
        for entry in kust.get("labels", []):
            doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
        if "namespace" in kust and doc["kind"] != "Namespace":
            doc["metadata"]["namespace"] = kust["namespace"]
        for image in kust.get("images", []):
            for c in containers(doc):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
        for patch in kust.get("patches", []):
            target = patch["target"]
            if doc["kind"] == target["kind"] and doc["metadata"]["name"] == target["name"]:
                _patch(doc, yaml.safe_load(patch["patch"]))
    return docs


@functools.cache
def _crd_validator(key: str) -> jsonschema.Draft202012Validator:
    defs_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    version = [v for v in sorted(p.name for p in defs_dir.iterdir()) if v.endswith("-local-strict")][-1]
    defs = Resource.from_contents(json.loads((defs_dir / version / "_definitions.json").read_text()))
    return jsonschema.Draft202012Validator(SCHEMAS[key], registry=defs @ Registry())


def validate(doc: Dict[str, Any]) -> str:
    """Validate one document: a built-in kind against Kubernetes' schema (strict: unknown fields
    fail), a custom resource against :mod:`helpers.crd_schemas`. Returns what it was checked as."""
    key = f"{doc['apiVersion']}/{doc['kind']}"
    if key in SCHEMAS:
        _crd_validator(key).validate(doc)
        return key
    if doc["apiVersion"].startswith("kustomize.config.k8s.io"):
        raise AssertionError("a Kustomization is not a resource")
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    return "k8s " + key


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command, args and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def pytorchjob_env(job: Dict[str, Any]) -> Dict[str, str]:
    """What Kubeflow's training-operator (v1.9, pkg/controller.v1/pytorch/envvar.go and
    elastic.go) appends to the environment of a Worker container of an elastic PyTorchJob
    without a Master replica."""
    spec = job["spec"]
    ep = spec["elasticPolicy"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    env = {"PYTHONUNBUFFERED": "1"}
    if "nprocPerNode" in spec:
        env["PET_NPROC_PER_NODE"] = spec["nprocPerNode"]
    host = ep.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    port = ep.get("rdzvPort") or next(p["containerPort"] for c in worker["template"]["spec"]["containers"]
                                      if c["name"] == "pytorch" for p in c.get("ports", [])
                                      if p["name"] == "pytorchjob-port")
    env["PET_RDZV_ENDPOINT"] = f"{host}:{port}"
    env["PET_RDZV_BACKEND"] = ep.get("rdzvBackend", "c10d")
    if "minReplicas" in ep or "maxReplicas" in ep:
        env["PET_NNODES"] = f"{ep['minReplicas']}:{ep['maxReplicas']}"
    else:
        env["PET_NNODES"] = str(worker["replicas"])
    if "maxRestarts" in ep:
        env["PET_MAX_RESTARTS"] = str(ep["maxRestarts"])
    if "nProcPerNode" in ep:
        env["PET_NPROC_PER_NODE"] = str(ep["nProcPerNode"])
    if "rdzvId" in ep:
        env["PET_RDZV_ID"] = ep["rdzvId"]
    if ep.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in ep["rdzvConf"])
    if ep.get("standalone"):
        env["PET_STANDALONE"] = ""
    return env
