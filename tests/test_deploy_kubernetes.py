"""deploy/kubernetes: every manifest validates offline, the policies agree with elasticrun
(exit codes, grace period, /dev/shm, the operator's PET_* variables), and the PyTorchJob's
container runs as local processes — its exact command line and the environment the operator
injects, its Secrets as files — against a local 3-member etcd with TLS and authentication set
up by the manifests' own etcd-auth Job script, scaled 1 → 2 → 1 pods while it trains.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import jsonschema
import kubernetes_validate
import psutil
import pytest

from elasticrun.cli.run_config import build_config
from elasticrun.cli.torchrun_args import Parser
from elasticrun.launch.config import LaunchConfig, RdzvBackend
from elasticrun.sizes import parse_size
from elasticrun.store.server import EtcdServer, HealthTLS, ServerTLS, free_port

from helpers import kube
from helpers.procs import REPO, wait_until, worker_env
from helpers.tls import Certs

pytestmark = pytest.mark.integration  # starts etcd or processes

DEPLOY = REPO / "deploy" / "kubernetes"
KUSTOMIZATIONS = ["base", "pytorchjob", "jobset", "monitoring", "overlays/example"]
RETRYABLE = [130, 137, 138, 143]  # Kubeflow's ExitCode policy restarts these; any other code is permanent
STEP = re.compile(r"step (\d+) loss \S+ world (\d+)")


def docs_of(name: str) -> List[Dict[str, Any]]:
    return kube.render(DEPLOY / name)


def find(docs: List[Dict[str, Any]], kind: str, name: str = "") -> Dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (not name or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def pod_spec(doc: Dict[str, Any]) -> Dict[str, Any]:
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def flag(args: List[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(name + "="))


def size(text: str) -> float:
    """A size as elasticrun reads it (``6GiB``) or a Kubernetes quantity (``8Gi``): the same one parser."""
    return float(parse_size(text))


def test_every_manifest_validates_offline_and_a_typo_fails() -> None:
    checked = set()
    for name in KUSTOMIZATIONS:
        for doc in docs_of(name):
            checked.add(kube.validate(doc))
    assert checked == {
        "k8s v1/Service", "k8s apps/v1/StatefulSet", "k8s policy/v1/PodDisruptionBudget", "k8s batch/v1/Job",
        "k8s v1/PersistentVolumeClaim", "k8s v1/Namespace", "cert-manager.io/v1/Issuer",
        "cert-manager.io/v1/Certificate", "kubeflow.org/v1/PyTorchJob", "jobset.x-k8s.io/v1alpha2/JobSet",
        "monitoring.coreos.com/v1/ServiceMonitor"}
    # the checks can fail: a misspelt field in a pod template (in a CRD and in a Job), in a CRD's
    # own fields and in a built-in kind, a value outside a CRD's enum
    for name, kind, path, key, value in (("pytorchjob", "PyTorchJob", "pod", "terminationGracePeriod", 90),
                                         ("jobset", "JobSet", "pod", "restartPolicyy", "Never"),
                                         ("pytorchjob", "PyTorchJob", "elastic", "minReplica", 1),
                                         ("pytorchjob", "PyTorchJob", "elastic", "rdzvBackend", "etcd3"),
                                         ("base", "StatefulSet", "sts", "podManagmentPolicy", "Parallel")):
        doc = copy.deepcopy(find(docs_of(name), kind))
        target = pod_spec(doc) if path == "pod" else doc["spec"]["elasticPolicy"] if path == "elastic" \
            else doc["spec"]
        target[key] = value
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            kube.validate(doc)


@pytest.mark.parametrize("name", ["pytorchjob", "jobset"])
def test_job_policies_agree_with_elasticrun(name: str) -> None:
    docs = docs_of(name)
    job = find(docs, "PyTorchJob" if name == "pytorchjob" else "JobSet")
    spec = pod_spec(job)
    (c,) = spec["containers"]
    assert spec["terminationGracePeriodSeconds"] > float(flag(c["args"], "--shutdown-timeout")) + 10
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes[next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")]["emptyDir"]
    assert shm["medium"] == "Memory" and size(shm["sizeLimit"]) > size(flag(c["args"], "--snapshot-memory"))
    if name == "pytorchjob":
        assert c["name"] == "pytorch", "the operator finds its container by this name"
        assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "ExitCode"
    else:
        assert spec["restartPolicy"] == "Never"
        rules = job["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
        codes = {r["action"]: r["onExitCodes"] for r in rules if "onExitCodes" in r}
        assert codes["Count"] == {"containerName": c["name"], "operator": "In", "values": RETRYABLE}
        assert codes["FailJob"] == {"containerName": c["name"], "operator": "NotIn", "values": [0, *RETRYABLE]}
        assert [r["action"] for r in rules][0] == "Ignore", "evictions and preemptions first: not counted"
    # every Secret the pods and the etcd members mount is issued by a Certificate, or is the
    # one Secret of passwords docs/deploy.md has the user create
    issued = {d["spec"]["secretName"] for d in docs if d["kind"] == "Certificate"}
    for doc in docs:
        for v in (v for d in kube._walk(doc) for v in d.get("volumes", []) if isinstance(d.get("volumes"), list)):
            if "secret" in v:
                assert v["secret"]["secretName"] in issued | {"elasticrun-etcd-auth"}, v
    assert "create secret generic elasticrun-etcd-auth" in (REPO / "docs" / "deploy.md").read_text()


def test_etcd_statefulset_members_certificate_and_disruption_budget() -> None:
    docs = docs_of("base")
    sts = find(docs, "StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    affinity = sts["spec"]["template"]["spec"]["affinity"]
    anti = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname" and anti[0]["labelSelector"]["matchLabels"] == labels
    assert find(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == labels
    headless = find(docs, "Service", "etcd")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] and headless["selector"] == labels
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    members = re.findall(r"(etcd-\d)=https://([^:]+):2380", flag(args, "--initial-cluster"))
    assert [m for m, _ in members] == [f"etcd-{i}" for i in range(3)]
    names = find(docs, "Certificate", "etcd-server")["spec"]["dnsNames"]
    assert all(host in names and host == f"{m}.{sts['spec']['serviceName']}" for m, host in members)
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args
    # the agents' endpoint list (PyTorchJob via the operator, JobSet written out) is these members
    endpoint = kube.pytorchjob_env(find(docs_of("pytorchjob"), "PyTorchJob"))["PET_RDZV_ENDPOINT"]
    assert endpoint.split(",") == [f"{host}:2379" for _, host in members]
    js_env = {e["name"]: e["value"] for e in pod_spec(find(docs_of("jobset"), "JobSet"))["containers"][0]["env"]}
    assert js_env["PET_RDZV_ENDPOINT"] == endpoint


def agent_config(job: Dict[str, Any]) -> LaunchConfig:
    """The launch configuration of the job's container: its command line and environment (what the
    operator injects included), parsed as elasticrun parses them."""
    (c,) = pod_spec(job)["containers"]
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    if job["kind"] == "PyTorchJob":
        env.update(kube.pytorchjob_env(job))
    return build_config(Parser().parse([*c["command"][1:], *c["args"]], env))


def test_monitoring_scrapes_the_agents_metrics_port() -> None:
    docs = docs_of("monitoring")
    svc = find(docs, "Service", "elastic-demo-metrics")
    monitor = find(docs, "ServiceMonitor", "elastic-demo")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0] == {"port": "metrics", "path": "/metrics", "interval": "15s"}
    assert svc["spec"]["ports"][0]["name"] == "metrics"
    for name in ("pytorchjob", "jobset"):
        job = find(docs_of(name), "PyTorchJob" if name == "pytorchjob" else "JobSet")
        pod = (job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"] if name == "pytorchjob"
               else job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        (c,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert svc["spec"]["ports"][0]["targetPort"] in ports
        # the agent serves /metrics on that port, bound where the scraper (via the Service's endpoints,
        # the pod's IP) and the kubelet's probe (the pod's IP) reach it: not loopback, the default
        cfg = agent_config(job)
        assert cfg.logs.metrics_port == ports[svc["spec"]["ports"][0]["targetPort"]] == svc["spec"]["ports"][0]["port"]
        host = cfg.logs.metrics_host
        assert ipaddress.ip_address(host).is_unspecified, f"{name}: /metrics on {host}"
        probe = c["livenessProbe"]["httpGet"]
        assert probe["path"] == "/metrics" and ports.get(probe["port"], probe["port"]) == cfg.logs.metrics_port
        assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] >= 60, \
            "a minute at least before a slow answer restarts an agent"
    etcd = find(docs_of("base"), "Service", "etcd")
    assert find(docs, "ServiceMonitor", "etcd")["spec"]["selector"]["matchLabels"].items() <= \
        etcd["metadata"]["labels"].items()


def test_overlay_sets_namespace_image_and_replicas() -> None:
    docs = docs_of("overlays/example")
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"elasticrun"}
    images = {c["image"] for d in docs for c in kube.containers(d)}
    assert "registry.example.com/elasticrun:0.3.0" in images and "elasticrun" not in images
    assert find(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3


def test_every_variable_the_operator_injects_is_accepted() -> None:
    job = copy.deepcopy(find(docs_of("pytorchjob"), "PyTorchJob"))
    job["spec"]["elasticPolicy"]["nProcPerNode"] = 1  # deprecated spelling: also injected
    env = kube.pytorchjob_env(job)
    assert set(env) == {"PYTHONUNBUFFERED", "PET_NPROC_PER_NODE", "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND",
                        "PET_NNODES", "PET_MAX_RESTARTS", "PET_RDZV_ID", "PET_RDZV_CONF"}
    (c,) = pod_spec(job)["containers"]
    env = {**{e["name"]: e["value"] for e in c["env"]}, **env}
    cfg = build_config(Parser().parse([*c["command"][1:], *c["args"]], env))  # the container's command line
    assert (cfg.rendezvous.nnodes_min, cfg.rendezvous.nnodes_max, cfg.workers.nproc_per_node,
            cfg.rendezvous.max_restarts) == (1, 4, 1, 3)
    assert cfg.rendezvous.rdzv_backend is RdzvBackend.ETCD and cfg.rendezvous.rdzv_id == "elastic-demo"
    assert (cfg.workers.shutdown_timeout, cfg.memory.snapshot_memory, cfg.etcd.etcd_user) == (60.0, 6 * 2**30,
            "elastic-demo")
    assert cfg.workers.entrypoint == "/app/train.py" and cfg.workers.args[0] == "--epochs=1000"
    assert cfg.rendezvous.rdzv_endpoint == "etcd-0.etcd:2379,etcd-1.etcd:2379,etcd-2.etcd:2379"
    assert (cfg.rendezvous.join_timeout, cfg.rendezvous.stability_window) == (900.0, 10.0)
    # elasticPolicy.standalone: true → PET_STANDALONE="" (presence means on; torchrun fails on it)
    job["spec"]["elasticPolicy"]["standalone"] = True
    assert build_config(Parser().parse(["/app/train.py"], kube.pytorchjob_env(job))).rendezvous.standalone is True


# -- the PyTorchJob as local processes ------------------------------------------------------------

class LocalCluster:
    """What the pods see, on loopback: 3 etcd members with TLS (client certificates required),
    the Secrets as files, the member names mapped to their local addresses."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.certs = Certs(root / "pki")
        crt, key = self.certs.server
        health = HealthTLS(str(self.certs.ca), *map(str, self.certs.client("root")))
        self.members = [EtcdServer(name=f"etcd-{i}", data_dir=str(root / f"etcd-{i}"), health_tls=health,
                                   tls=ServerTLS(str(crt), str(key), client_ca=str(self.certs.ca)),
                                   # etcd's defaults, not the tests' fast ones: no elections on a busy machine
                                   extra_args=["--heartbeat-interval=100", "--election-timeout=1000"])
                        for i in range(3)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial
        self.ports: Dict[Tuple[str, int], int] = {}  # (pod, container port): the port it has here
        self.secrets: Dict[str, Dict[str, str]] = {"elasticrun-etcd-auth": {"root-password": "r00t-pw",
                                                                             "job-password": "j0b-pw"}}
        for secret, cn in (("etcd-admin-tls", "root"), ("elasticrun-job-tls", "elasticrun-job")):
            c, k = self.certs.client(cn)
            self.secrets[secret] = {"ca.crt": self.certs.ca.read_text(), "tls.crt": c.read_text(),
                                    "tls.key": k.read_text()}

    def start(self) -> None:
        for m in self.members:
            m.start(wait_healthy=False)
        for m in self.members:
            m.wait_healthy(90)  # generous: a loaded CI machine

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def pod(self, name: str, spec: Dict[str, Any], injected: Dict[str, str],
            init: str = "") -> Tuple[List[str], Dict[str, str]]:
        """argv and environment of the pod's container (or of its init container ``init``),
        localized: mounts become directories, member names their loopback addresses, the
        image's files the repo's. ``injected``: what the operator adds (main containers only)."""
        if init:
            (c,) = [c for c in spec["initContainers"] if c["name"] == init]
            injected = {}
        else:
            (c,) = spec["containers"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        paths: Dict[str, str] = {}
        for mount in c.get("volumeMounts", []):
            vol = volumes[mount["name"]]
            local = self.root / name / mount["name"]
            if "secret" in vol:
                data = self.secrets[vol["secret"]["secretName"]]
                items = vol["secret"].get("items") or [{"key": k, "path": k} for k in data]
                local.mkdir(parents=True, exist_ok=True)
                for item in items:
                    (local / item["path"]).write_text(data[item["key"]])
                    os.chmod(local / item["path"], vol["secret"].get("defaultMode", 0o644))
            elif "persistentVolumeClaim" in vol:
                local = self.root / "pvc" / vol["persistentVolumeClaim"]["claimName"]
                local.mkdir(parents=True, exist_ok=True)
            else:
                assert vol["emptyDir"]["medium"] == "Memory" and mount["mountPath"] == "/dev/shm"
                continue  # this machine's /dev/shm
            paths[mount["mountPath"]] = str(local)
        for i, m in enumerate(self.members):
            paths[f"etcd-{i}.etcd:2379"] = m.endpoint
        paths["etcd-client:2379"] = self.members[1].endpoint  # the Service: one of the members
        paths["/app/train.py"] = str(REPO / "examples" / "train.py")  # deploy/Dockerfile copies it there
        for port in c.get("ports", []):  # pods share this machine: each its own free port
            local_port = self.ports.setdefault((name, port["containerPort"]), free_port())
            paths[f"--metrics-port={port['containerPort']}"] = f"--metrics-port={local_port}"

        def localize(text: str) -> str:
            for k in sorted(paths, key=len, reverse=True):
                text = text.replace(k, paths[k])
            return text

        env = {e["name"]: e["value"] for e in c.get("env", [])}
        env.update(injected)  # the operator appends its variables after the container's: they win
        env = {k: localize(kube.expand(v, env)) for k, v in env.items()}
        argv = [localize(kube.expand(a, env)) for a in c.get("command", []) + c.get("args", [])]
        if argv[0] == "elasticrun":
            argv[:1] = [sys.executable, "-m", "elasticrun"]
        return argv, worker_env(env)


@pytest.fixture
def cluster(tmp_path: Path):
    local = LocalCluster(tmp_path)
    local.start()
    yield local
    local.stop()


def scrape_from_outside(port: int) -> str:
    """``/metrics`` on ``port`` as a scraper on another host reaches it: the agent listens on the
    wildcard address, and answers on this machine's first address that is not loopback (where the
    machine has one)."""
    listening = [c.laddr for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
                 and c.laddr.port == port]
    assert listening and all(ipaddress.ip_address(a.ip).is_unspecified for a in listening), listening
    outside = [a.address for nic in psutil.net_if_addrs().values() for a in nic
               if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]
    with urllib.request.urlopen(f"http://{(outside or ['127.0.0.1'])[0]}:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def metric(text: str, name: str) -> Optional[float]:
    """The value of the one sample ``name`` in a Prometheus text exposition (None without it)."""
    found = [m.group(1) for m in re.finditer(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)]
    return float(found[0]) if len(found) == 1 else None


def steps(*outs: Path) -> List[Tuple[int, int]]:
    return sorted({(int(m[1]), int(m[2])) for p in outs for m in STEP.finditer(p.read_text(errors="replace"))})


def test_pytorchjob_pods_train_through_scale_up_and_down(cluster: LocalCluster, tmp_path: Path) -> None:
    docs = docs_of("pytorchjob")
    job = copy.deepcopy(find(docs, "PyTorchJob"))
    spec = pod_spec(job)
    # 1. a pod's init container waits for the job's etcd user, which the etcd-auth Job creates
    argv, env = cluster.pod("worker-0", spec, {}, init="wait-for-etcd-user")
    waiter = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    argv, env = cluster.pod("auth", find(docs, "Job", "etcd-auth")["spec"]["template"]["spec"], {})
    auth = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert waiter.poll() is None, "the init container waited for the user"
    assert auth.returncode == 0, auth.stdout + auth.stderr
    assert waiter.wait(60) == 0 and "waiting for etcd and its user elastic-demo" in waiter.communicate()[0]
    assert "etcd user elastic-demo may read and write /elasticrun/elastic-demo/" in auth.stdout
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, "the Job may run again: " + again.stderr
    # 2. the PyTorchJob's pods, with what the operator injects (a shorter last_call_timeout than the
    # manifest's 10 s keeps the test short) and a step pace for this shared machine
    job["spec"]["elasticPolicy"]["rdzvConf"][1]["value"] = "2"
    spec["containers"][0]["args"].append("--step-sleep=0.03")
    injected = kube.pytorchjob_env(job)
    procs: Dict[int, subprocess.Popen] = {}
    outs: Dict[int, Path] = {}

    def start(index: int) -> None:  # the operator creates elastic-demo-worker-<index>
        argv, env = cluster.pod(f"worker-{index}", spec, injected)
        outs[index] = tmp_path / f"worker-{index}.out"
        with open(outs[index], "wb") as out:
            procs[index] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=str(REPO))

    def world_steps(world: int, after: int = 0) -> List[int]:
        return [s for s, w in steps(*outs.values()) if w == world and s > after]

    try:
        start(0)  # replicas: 1
        wait_until(lambda: len(world_steps(1)) >= 10, 120, "training at world 1")
        start(1)  # kubectl scale pytorchjob elastic-demo --replicas=2
        wait_until(lambda: len(world_steps(2)) >= 10, 120, "training at world 2")
        # each pod's /metrics answers where Prometheus and the kubelet reach it (the probe's port)
        probe_port = spec["containers"][0]["livenessProbe"]["httpGet"]["port"]
        container_port = {p["name"]: p["containerPort"] for p in spec["containers"][0]["ports"]}[probe_port]
        for index in (0, 1):
            port = cluster.ports[(f"worker-{index}", container_port)]
            wait_until(lambda p=port: metric(scrape_from_outside(p), "elasticrun_world_size") == 2.0, 30,
                       f"worker-{index}'s /metrics to show world 2")
        # `elasticrun status` as docs/deploy.md runs it through kubectl exec, in a pod's environment
        _, env = cluster.pod("worker-0", spec, injected)
        status = subprocess.run(["sh", "-c", f'"{sys.executable}" -m elasticrun status --rdzv-endpoint '
                                 '"$PET_RDZV_ENDPOINT" --rdzv-id "$PET_RDZV_ID" --json'],
                                env=env, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["world_size"] == 2, status.stdout
        # kubectl scale ... --replicas=1: the operator deletes worker-1, the kubelet sends SIGTERM
        last2 = max(world_steps(2))
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(120) in RETRYABLE, outs[1].read_text()[-3000:]
        wait_until(lambda: len(world_steps(1, after=last2)) >= 10, 120, "training at world 1 after the scale-down")
        # preemption of the last pod: it drains to a checkpoint and exits with a retryable code
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(120) in RETRYABLE, outs[0].read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
    text = outs[0].read_text(errors="replace")
    stops = re.findall(r"stopped: SIGTERM at step (\d+) world 1", text)  # the last: the preemption's
    assert stops, text[-3000:]
    assert (tmp_path / "pvc" / "elasticrun-checkpoints" / "elastic-demo" / f"step-{int(stops[-1]):08d}").is_dir()
    seen = [s for s, _ in steps(*outs.values())]
    assert seen == sorted(set(seen)) and seen[-1] >= last2 + 10, "training went on through both changes"
