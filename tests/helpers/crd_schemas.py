"""Minimal JSON schemas of the custom resources in deploy/kubernetes, for offline validation.

Written for these tests from the CRDs' API references (Kubeflow training-operator v1.9
``PyTorchJob``, JobSet v0.8 ``jobset.x-k8s.io/v1alpha2``, cert-manager v1 ``Certificate`` and
``Issuer``, prometheus-operator ``monitoring.coreos.com/v1 ServiceMonitor``): only the fields
the manifests use, every object closed (``additionalProperties: false``) so that a misspelt
field fails. Embedded pod and Job templates are checked against the Kubernetes schemas that
``kubernetes-validate`` ships (``K8S``: its ``_definitions.json``).
"""

from __future__ import annotations

from typing import Any, Dict

K8S = "https://kubernetes.io/api/_definitions.json#/$defs/"
META = {"$ref": K8S + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
POD_TEMPLATE = {"$ref": K8S + "io.k8s.api.core.v1.PodTemplateSpec"}
JOB_SPEC = {"$ref": K8S + "io.k8s.api.batch.v1.JobSpec"}
LABEL_SELECTOR = {"$ref": K8S + "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"}
STR = {"type": "string"}
INT = {"type": "integer"}


def obj(required: tuple = (), **props: Any) -> Dict[str, Any]:
    """A closed object schema."""
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


def resource(api_version: str, kind: str, spec: Dict[str, Any]) -> Dict[str, Any]:
    return obj(("apiVersion", "kind", "metadata", "spec"), apiVersion={"const": api_version},
               kind={"const": kind}, metadata=META, spec=spec)


ISSUER_REF = obj(("name",), name=STR, kind={"enum": ["Issuer", "ClusterIssuer"]}, group=STR)

SCHEMAS: Dict[str, Dict[str, Any]] = {
    "kubeflow.org/v1/PyTorchJob": resource("kubeflow.org/v1", "PyTorchJob", obj(
        ("pytorchReplicaSpecs",),
        nprocPerNode=STR,
        elasticPolicy=obj(
            minReplicas=INT, maxReplicas=INT, maxRestarts=INT, nProcPerNode=INT, standalone={"type": "boolean"},
            rdzvBackend={"enum": ["c10d", "etcd", "etcd-v2"]}, rdzvHost=STR, rdzvPort=INT, rdzvId=STR,
            rdzvConf={"type": "array", "items": obj(("key", "value"), key=STR, value=STR)},
        ),
        runPolicy=obj(backoffLimit=INT, activeDeadlineSeconds=INT, ttlSecondsAfterFinished=INT,
                      cleanPodPolicy={"enum": ["All", "Running", "None"]}, suspend={"type": "boolean"}),
        pytorchReplicaSpecs=obj(
            Master=obj(("template",), replicas={"const": 1}, template=POD_TEMPLATE,
                       restartPolicy={"enum": ["Always", "OnFailure", "Never", "ExitCode"]}),
            Worker=obj(("template",), replicas={"type": "integer", "minimum": 1}, template=POD_TEMPLATE,
                       restartPolicy={"enum": ["Always", "OnFailure", "Never", "ExitCode"]}),
        ),
    )),
    "jobset.x-k8s.io/v1alpha2/JobSet": resource("jobset.x-k8s.io/v1alpha2", "JobSet", obj(
        ("replicatedJobs",),
        failurePolicy=obj(
            maxRestarts=INT,
            rules={"type": "array", "items": obj(
                ("name", "action"), name=STR,
                action={"enum": ["FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"]},
                onJobFailureReasons={"type": "array", "items": {"enum": [
                    "BackoffLimitExceeded", "DeadlineExceeded", "PodFailurePolicy", "MaxFailedIndexesExceeded",
                    "FailedIndexes"]}},
                targetReplicatedJobs={"type": "array", "items": STR},
            )},
        ),
        replicatedJobs={"type": "array", "minItems": 1, "items": obj(
            ("name", "template"), name=STR, replicas={"type": "integer", "minimum": 0},
            template=obj(("spec",), metadata=META, spec=JOB_SPEC),
        )},
    )),
    "cert-manager.io/v1/Issuer": resource("cert-manager.io/v1", "Issuer", obj(
        selfSigned=obj(), ca=obj(("secretName",), secretName=STR),
    )),
    "cert-manager.io/v1/Certificate": resource("cert-manager.io/v1", "Certificate", obj(
        ("secretName", "issuerRef"),
        secretName=STR, commonName=STR, isCA={"type": "boolean"}, duration=STR,
        dnsNames={"type": "array", "items": STR}, ipAddresses={"type": "array", "items": STR},
        usages={"type": "array", "items": {"enum": ["server auth", "client auth", "digital signature",
                                                     "key encipherment", "cert sign"]}},
        privateKey=obj(algorithm={"enum": ["RSA", "ECDSA", "Ed25519"]}, size=INT),
        issuerRef=ISSUER_REF,
    )),
    "monitoring.coreos.com/v1/ServiceMonitor": resource("monitoring.coreos.com/v1", "ServiceMonitor", obj(
        ("selector", "endpoints"),
        selector=LABEL_SELECTOR,
        endpoints={"type": "array", "items": obj(port=STR, path=STR, interval={"type": "string",
                                                                                "pattern": "^[0-9]+[smh]$"},
                                                  scheme={"enum": ["http", "https"]})},
    )),
}
