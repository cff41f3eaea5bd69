"""From parsed ``elasticrun run`` arguments to a :class:`~elasticrun.launch.config.LaunchConfig`.

An option fills the fields its entry in :mod:`elasticrun.cli.run_options` names; a plain option is
copied into its one field, converted as the entry says. The joint ones are decided here, with what
each torchrun flag means (see docs/cli.md, "torchrun flags"):

- the rendezvous: ``--standalone`` (a private etcd); ``--rdzv-backend etcd|etcd-v2|etcd-v3``, or
  no backend with ``--rdzv-endpoint`` (an etcd server somewhere); ``c10d`` (the agent on the
  endpoint's host hosts the job's etcd there) and ``static``, torchrun's default (node rank 0
  hosts it at ``--master-addr:--master-port``, default port 29500);
- ``--rdzv-conf`` keys, torchrun's mapped to elasticrun's settings, elasticrun's own added;
- values elasticrun has no equivalent of (a custom ``--logs-specs``, an unknown event handler) are
  refused with one line.
"""

from __future__ import annotations

import uuid
from typing import Any, Dict, Tuple

from elasticrun.cli.run_options import RDZV_CONF, Opt, all_options
from elasticrun.cli.torchrun_args import Parsed
from elasticrun.errors import ConfigError, StoreError
from elasticrun.launch.config import (
    EtcdConfig,
    LaunchConfig,
    RdzvBackend,
    RendezvousConfig,
    parse_nnodes,
    parse_nproc,
)
from elasticrun.store.types import parse_endpoints

STATIC_PORT = 29500  # torchrun's default --master-port
C10D_PORT = 29400  # torchrun's default port of a c10d endpoint without one
BACKENDS = {"etcd": RdzvBackend.ETCD, "etcd-v2": RdzvBackend.ETCD, "etcd-v3": RdzvBackend.ETCD,
            "c10d": RdzvBackend.C10D, "static": RdzvBackend.STATIC}
EVENT_HANDLERS = ("null", "console", "dynamic_rendezvous")

def parse_rdzv_conf(text: str, where: str = "--rdzv-conf") -> Dict[str, str]:
    """``"a=1,b=2"`` → ``{"a": "1", "b": "2"}``; one clear error for a malformed or unknown key."""
    conf: Dict[str, str] = {}
    for item in (p.strip() for p in str(text or "").split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ConfigError(f"{where} {text!r}: use key=value,key=value (e.g. join_timeout=900)")
        if key not in RDZV_CONF:
            if key == "etcd_prefix":
                raise ConfigError(f"{where}: etcd_prefix is not supported (elasticrun keeps a job's keys under "
                                  "/elasticrun/<rdzv-id>/); remove it")
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {', '.join(sorted(RDZV_CONF))}")
        conf[key] = value
    return conf


def _conf_value(key: str, kind: str, value: str, where: str) -> Any:
    try:
        if kind == "seconds":
            number = float(value)
            if not number >= 0 or number == float("inf"):  # also nan
                raise ValueError
            return number
        if kind == "count":
            number = int(value)
            if number < 0:
                raise ValueError
            return number
    except ValueError:
        raise ConfigError(f"{where}: {key}={value!r} must be a finite number, 0 or more") from None
    if kind == "bool":
        low = value.lower()
        if low in ("1", "true", "t", "yes", "y"):
            return True
        if low in ("0", "false", "f", "no", "n"):
            return False
        raise ConfigError(f"{where}: {key}={value!r} is not a boolean (use true or false)")
    if kind == "protocol" and value.lower() not in ("http", "https"):
        raise ConfigError(f"{where}: protocol={value!r}: use http or https")
    if kind == "store_type" and value.lower() != "tcp":
        raise ConfigError(f"{where}: store_type={value!r} is not supported (the job's state lives in etcd); "
                          "remove it")
    return value


DEFAULT_LOGS_SPECS = "torch.distributed.elastic.multiprocessing:DefaultLogsSpecs"  # torchrun's "default" entry point


def _default_logs_specs(name: str) -> bool:
    """Whether ``--logs-specs NAME`` names torchrun's own DefaultLogsSpecs (the layout elasticrun writes)."""
    if name == "default":
        return True
    from importlib import metadata

    found = metadata.entry_points().select(group="torchrun.logs_specs", name=name)
    return any(ep.value.replace(".api:", ":") == DEFAULT_LOGS_SPECS for ep in found)


def _check_torchrun_choices(p: Parsed) -> None:
    """One line for torchrun values elasticrun has no equivalent of (a custom LogsSpecs, an event handler)."""
    if p.given("logs_specs"):
        name = str(p.values["logs_specs"] or "").strip()
        if not _default_logs_specs(name):
            where = p.where("logs_specs")
            where += f" {name!r}" if where.startswith("-") else ""
            raise ConfigError(f"{where}: only torchrun's default LogsSpecs ('default') is supported: "
                              "elasticrun writes that layout itself (see --log-dir, -r, -t); remove it")
    handler = str(p.values["event_log_handler"]).strip()
    if handler not in EVENT_HANDLERS:
        raise ConfigError(f"{p.where('event_log_handler')}: elasticrun records events in etcd (`elasticrun "
                          f"status`) and on stderr; use one of {', '.join(EVENT_HANDLERS)}")


def _shutdown_timeout(p: Parsed) -> float:
    if p.given("shutdown_timeout"):
        return float(p.values["shutdown_timeout"])
    text = p.env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if text:
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds < float("inf"):
            raise ConfigError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={text!r}: expected a number of seconds, 0 or more")
        return seconds
    return 30.0


def _endpoint(host_port: str, default_port: int, where: str) -> str:
    """``host[:port]`` with torchrun's default port; one endpoint only."""
    text = host_port.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    if not text or "," in text:
        raise ConfigError(f"{where}: give one HOST:PORT, the node that hosts the job's etcd")
    if text.startswith("["):  # [v6]:port
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            host, port = text, ""
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{where}: expected HOST:PORT with a port 1 .. 65535, e.g. node0:{default_port}")
    if not host:
        raise ConfigError(f"{where}: expected HOST:PORT, e.g. node0:{default_port}")
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port or default_port}"


def _rendezvous(p: Parsed, cfg: LaunchConfig) -> None:
    """Decide the rendezvous of ``cfg`` (backend, endpoint, hosting, node rank, nnodes)."""
    r = cfg.rendezvous
    endpoint = str(p.values["rdzv_endpoint"] or "").strip()
    backend_name = _backend_name(p)
    if _standalone(p, backend_name, endpoint, r.nnodes_max):
        r.standalone, r.rdzv_backend, r.rdzv_endpoint = True, RdzvBackend.ETCD, ""
        if not p.given("rdzv_id"):
            r.rdzv_id = f"standalone-{uuid.uuid4().hex[:8]}"
        return
    # Without a backend an endpoint is an etcd server; without either, torchrun's static rendezvous.
    backend = BACKENDS[backend_name or ("etcd" if endpoint else "static")]
    r.rdzv_backend = backend
    if backend is RdzvBackend.ETCD:
        r.rdzv_endpoint = _etcd_endpoints(p, endpoint)
        return
    _refuse_security(p, cfg.etcd, backend)
    if backend is RdzvBackend.C10D:
        r.rdzv_endpoint = _c10d_endpoint(p, endpoint)
    else:
        _static(p, r, endpoint)


def _backend_name(p: Parsed) -> str:
    """``--rdzv-backend`` in lower case ("" when not given); one line for an unknown one."""
    name = str(p.values["rdzv_backend"] or "").strip().lower() if p.given("rdzv_backend") else ""
    if name and name not in BACKENDS:
        raise ConfigError(f"{p.where('rdzv_backend')}: unknown backend; use etcd (etcd-v2, etcd-v3: the same) for "
                          "an etcd server at --rdzv-endpoint, or c10d / static for an etcd the job hosts")
    return name


def _standalone(p: Parsed, backend_name: str, endpoint: str, nnodes_max: int) -> bool:
    """``--standalone``, or (like torchrun) one node with no rendezvous given: it needs no server."""
    if p.values["standalone"]:
        return True
    return not backend_name and not endpoint and not p.given("master_port") and nnodes_max == 1


def _etcd_endpoints(p: Parsed, endpoint: str) -> str:
    """An etcd server's ``host:port[,host:port...]``."""
    try:
        parse_endpoints(endpoint)
    except StoreError:
        raise ConfigError(f"{p.shown('rdzv_endpoint')}: expected host:port[,host:port...] with ports 1 .. "
                          "65535, e.g. etcd-host:2379") from None
    return endpoint


def _refuse_security(p: Parsed, etcd: EtcdConfig, backend: RdzvBackend) -> None:
    """The etcd a c10d/static job hosts is plain: one line for any TLS or user setting."""
    settings = {"etcd_user": etcd.etcd_user, "etcd_password": etcd.etcd_password,
                "etcd_password_file": etcd.etcd_password_file, "etcd_cacert": etcd.etcd_cacert,
                "etcd_cert": etcd.etcd_cert, "etcd_key": etcd.etcd_key}  # option dest → value
    secured = [p.where(k) for k in settings if settings[k] or (p.values.get(k) and p.given(k))]
    if secured:
        raise ConfigError(f"{secured[0]}: the etcd a {backend.value} job hosts is plain (no TLS, no users); "
                          "drop the etcd security settings, or run a secured etcd and use --rdzv-backend etcd")


def _c10d_endpoint(p: Parsed, endpoint: str) -> str:
    """c10d: the agent on the endpoint's host hosts the job's etcd on its port."""
    if not endpoint:
        raise ConfigError("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (the agent on HOST hosts the "
                          "job's etcd on PORT)")
    return _endpoint(endpoint, C10D_PORT, p.shown("rdzv_endpoint"))


def _static(p: Parsed, r: RendezvousConfig, endpoint: str) -> None:
    """torchrun's static rendezvous at --master-addr:--master-port (or an explicit endpoint): exactly MAX
    nodes, fixed node ranks, node rank 0 hosts the job's etcd."""
    v = p.values
    if endpoint:
        r.rdzv_endpoint = _endpoint(endpoint, STATIC_PORT, p.shown("rdzv_endpoint"))
    else:
        port = v["master_port"] if v["master_port"] is not None else STATIC_PORT  # its range: run_options
        addr = str(v["master_addr"] or "").strip() or "127.0.0.1"
        r.rdzv_endpoint = _endpoint(f"{addr}:{port}", STATIC_PORT, p.shown("master_addr"))
    r.nnodes_min = r.nnodes_max  # a static job has exactly MAX nodes, as in torchrun
    if r.node_rank is None:
        r.node_rank = 0  # torchrun's default --node-rank
    if r.rdzv_is_host is None:
        r.rdzv_is_host = r.node_rank == 0


def _apply_rdzv_conf(p: Parsed, fields: Dict[str, Any]) -> None:
    """``--rdzv-conf`` keys into ``fields`` (``{"group.field": value}``), where no dedicated flag was given."""
    where = p.where("rdzv_conf")
    flag_of_field = _flag_of_field(all_options())
    conf = parse_rdzv_conf(str(p.values["rdzv_conf"] or ""), where)
    for key, text in conf.items():
        field_name, kind = RDZV_CONF[key]
        value = _conf_value(key, kind, text, where)
        if field_name and not p.given(flag_of_field.get(field_name, "")):  # a dedicated flag wins
            fields[field_name] = value
    if ("keep_alive_interval" in conf or "keep_alive_max_attempt" in conf) and not (
        p.given("heartbeat_timeout") or "heartbeat_timeout" in conf
    ):
        interval = _conf_value("keep_alive_interval", "seconds", conf.get("keep_alive_interval", "5"), where)
        attempts = _conf_value("keep_alive_max_attempt", "count", conf.get("keep_alive_max_attempt", "3"), where)
        fields["rendezvous.heartbeat_timeout"] = float(interval) * float(attempts)
    protocol = conf.get("protocol", "").lower()
    if protocol == "https" and not fields.get("etcd.etcd_cacert"):
        raise ConfigError(f"{where}: protocol=https needs cacert=FILE (or --etcd-cacert FILE)")
    if protocol == "http" and fields.get("etcd.etcd_cacert"):
        raise ConfigError(f"{where}: protocol=http contradicts the CA certificate given; use protocol=https")


def _flag_of_field(options: Tuple[Opt, ...]) -> Dict[str, str]:
    """Field → the dest of the option that fills it alone (a ``--rdzv-conf`` key yields to that flag)."""
    return {opt.fills[0]: opt.dest for opt in options if not opt.joint and len(opt.fills) == 1}


def _direct(p: Parsed) -> Dict[str, Any]:
    """Every option that is not ``joint``: its one field, its value converted (run_options' table)."""
    fields: Dict[str, Any] = {}
    for opt in all_options():
        if opt.joint or not opt.fills:
            continue
        (name,) = opt.fills
        value = p.values[opt.dest]
        fields[name] = opt.convert(value, p.shown(opt.dest)) if opt.convert else value
    return fields


def _size(p: Parsed) -> Dict[str, Any]:
    """``--nnodes`` and ``--nproc-per-node`` (and ``--node-rank`` below the node count)."""
    v = p.values
    nmin, nmax = parse_nnodes(v["nnodes"], p.shown("nnodes"))
    nproc, kind = parse_nproc(v["nproc_per_node"], p.shown("nproc_per_node"))
    if v["node_rank"] is not None and v["node_rank"] >= nmax:
        raise ConfigError(f"{p.shown('node_rank')}: must be 0 .. {nmax - 1} with {p.shown('nnodes')} (give every "
                          "node its own rank below the node count)")
    return {"rendezvous.nnodes_min": nmin, "rendezvous.nnodes_max": nmax, "workers.nproc_per_node": nproc,
            "workers.device_kind": kind}


def _script_kind(p: Parsed) -> Dict[str, Any]:
    """``-m``, ``--no-python`` and ``--run-path``: how the script runs."""
    module, no_python = bool(p.values["module"]), bool(p.values["no_python"])
    if p.values["run_path"]:
        module = no_python = False  # torchrun: --run-path takes precedence
    elif module and no_python:
        raise ConfigError("don't use both the --no-python flag and the -m/--module flag at the same time")
    return {"workers.module": module, "workers.no_python": no_python}


def build_config(p: Parsed) -> LaunchConfig:
    """The launch configuration the parsed arguments ask for (not yet validated).

    Every option fills the fields its table entry names (:data:`~elasticrun.cli.run_options.Opt.fills`):
    the plain ones by :func:`_direct`, the joint ones by the rules here."""
    _check_torchrun_choices(p)
    fields: Dict[str, Any] = {"workers.entrypoint": p.script, "workers.args": list(p.script_args)}
    fields.update(_size(p))
    fields.update(_script_kind(p))
    fields.update(_direct(p))
    fields["workers.shutdown_timeout"] = _shutdown_timeout(p)
    if p.given("rdzv_id"):
        fields["rendezvous.rdzv_id"] = str(p.values["rdzv_id"])
    _apply_rdzv_conf(p, fields)
    cfg = LaunchConfig.of(fields)
    _rendezvous(p, cfg)
    return cfg
