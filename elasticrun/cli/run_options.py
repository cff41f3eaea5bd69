"""The options of ``elasticrun [run]``: every torchrun 2.13 flag plus elasticrun's own.

One table drives the parser (:mod:`elasticrun.cli.torchrun_args`), the ``--help`` page
(:mod:`elasticrun.cli.run_help`), the launch configuration and the tests. A torchrun flag keeps
torchrun's spellings (``--nproc-per-node`` and ``--nproc_per_node``) and can also come from its
``PET_<DEST>`` environment variable (``PET_NPROC_PER_NODE``), as torchrun's ``env`` actions read them.

Each option names the :class:`~elasticrun.launch.config.LaunchConfig` fields it fills (``fills``)
and how its value converts (``convert``, :mod:`elasticrun.cli.run_values`);
:mod:`elasticrun.cli.run_config` copies every option that is not ``joint`` into its field, and
decides the joint ones (the rendezvous, how the script runs) by its rules.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from elasticrun.cli import etcd_options, run_values
from elasticrun.health.straggler import StragglerAction
from elasticrun.job import env as job_env
from elasticrun.job.hints import AdaptationStrategy, RedistributionType


class Kind(enum.Enum):
    """How an option takes its value."""

    VALUE = "value"  # --opt VALUE / --opt=VALUE
    FLAG = "flag"  # --opt (True); ``negative`` spellings set False


class Type(enum.Enum):
    """What a value must parse as (checked by the parser, with the flag or variable named)."""

    STR = "str"
    INT = "int"
    FLOAT = "float"


@dataclass(frozen=True)
class Opt:
    """One option: its spellings, value, default, help, and where its environment value comes from."""

    dest: str
    names: Tuple[str, ...]
    help: str
    panel: str
    kind: Kind = Kind.VALUE
    type: Type = Type.STR
    default: Any = None
    metavar: str = ""
    choices: Tuple[str, ...] = ()
    torchrun: bool = False  # a torchrun flag: read PET_<DEST> when the flag is absent
    envvars: Tuple[str, ...] = ()  # elasticrun's own variables, read after PET_<DEST>
    negative: Tuple[str, ...] = ()  # FLAG spellings that set False (--no-prewarm)
    at_least: Optional[float] = None  # INT/FLOAT: the smallest value allowed
    more_than: Optional[float] = None  # FLOAT: values must be above this one
    at_most: Optional[float] = None  # INT/FLOAT: the largest value allowed
    range_note: str = ""  # said with a value out of range ("0 turns it off")
    # The LaunchConfig fields this option fills; () only for an option that is checked and fills nothing.
    fills: Tuple[str, ...] = ()
    # How the parsed value becomes the field's value (elasticrun.cli.run_values); None: as parsed.
    convert: Optional[run_values.Convert] = None
    # Decided together with other options by the rules of elasticrun.cli.run_config (the rendezvous,
    # how the script runs); otherwise the option fills its one field alone.
    joint: bool = False

    @property
    def pet(self) -> Optional[str]:
        """torchrun's environment variable for this option (``PET_`` + dest upper-cased)."""
        return f"PET_{self.dest.upper()}" if self.torchrun else None

    @property
    def long(self) -> str:
        """The main spelling (the first ``--`` name)."""
        return next(n for n in self.names if n.startswith("--"))


RDZV = "Rendezvous"
WORKERS = "Workers"
ELASTIC = "Elasticity"
LOGS = "Logs"
ETCD = etcd_options.PANEL

SIGNALS_DEFAULT = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

# --rdzv-conf key → (LaunchConfig field, kind). torchrun's keys first, then elasticrun's own; "": a key
# that fills no field by itself (keep_alive_* make heartbeat_timeout; protocol, store_type are checked).
RDZV_CONF: Dict[str, Tuple[str, str]] = {
    "join_timeout": ("rendezvous.join_timeout", "seconds"),
    "timeout": ("rendezvous.join_timeout", "seconds"),  # etcd-v1 and static backends' name for it
    "last_call_timeout": ("rendezvous.stability_window", "seconds"),
    "close_timeout": ("rendezvous.rdzv_close_timeout", "seconds"),
    "heartbeat_timeout": ("rendezvous.heartbeat_timeout", "seconds"),
    "read_timeout": ("etcd.etcd_timeout", "seconds"),
    "keep_alive_interval": ("", "seconds"),  # × keep_alive_max_attempt → heartbeat_timeout
    "keep_alive_max_attempt": ("", "count"),
    "is_host": ("rendezvous.rdzv_is_host", "bool"),
    "rank": ("rendezvous.node_rank", "count"),
    "protocol": ("", "protocol"),
    "cacert": ("etcd.etcd_cacert", "path"),
    "ca_cert": ("etcd.etcd_cacert", "path"),
    "cert": ("etcd.etcd_cert", "path"),
    "ssl_cert": ("etcd.etcd_cert", "path"),
    "key": ("etcd.etcd_key", "path"),
    "ssl_cert_key": ("etcd.etcd_key", "path"),
    "store_type": ("", "store_type"),
    "stability_window": ("rendezvous.stability_window", "seconds"),
    "rescale_timeout": ("rendezvous.rescale_timeout", "seconds"),
    "etcd_timeout": ("etcd.etcd_timeout", "seconds"),
    "etcd_members": ("rendezvous.etcd_members", "count"),  # the members a hosted etcd grows to (launch/etcdmembers.py)
}
RDZV_CONF_FIELDS = tuple(dict.fromkeys(name for name, _ in RDZV_CONF.values() if name))
# What the rendezvous rules decide (elasticrun.cli.run_config._rendezvous): backend, endpoint, hosting.
RENDEZVOUS_FIELDS = ("rendezvous.rdzv_backend", "rendezvous.rdzv_endpoint", "rendezvous.standalone",
                     "rendezvous.rdzv_id", "rendezvous.rdzv_is_host", "rendezvous.node_rank", "rendezvous.nnodes_min")
# The fields the positional arguments fill: SCRIPT and its arguments.
POSITIONAL_FIELDS = ("workers.entrypoint", "workers.args")
# The fields no option fills (each with the reason); tests/unit/cli/test_run_fields.py checks that every
# other LaunchConfig field is filled by an option.
INTERNAL_FIELDS: Tuple[str, ...] = ()


def _both(name: str) -> Tuple[str, ...]:
    """``--a-b`` and torchrun's underscore spelling ``--a_b``."""
    under = name.replace("-", "_")
    return (name,) if under == name or "_" not in under[2:] else (name, "--" + under[2:])


def _t(dest: str, names: Tuple[str, ...], help: str, panel: str, **kw: Any) -> Opt:
    return Opt(dest=dest, names=names, help=help, panel=panel, torchrun=True, **kw)


TORCHRUN_OPTIONS: Tuple[Opt, ...] = (
    _t("nnodes", ("--nnodes",), "Number of nodes: N, or MIN:MAX for an elastic job.", RDZV, metavar="N|MIN:MAX",
       default="1",
       fills=("rendezvous.nnodes_min", "rendezvous.nnodes_max"), joint=True),
    _t("nproc_per_node", _both("--nproc-per-node"), "Workers on this node: N, gpu, cpu or auto.", WORKERS,
       metavar="N", default="1",
       fills=("workers.nproc_per_node", "workers.device_kind"), joint=True),
    _t("rdzv_backend", _both("--rdzv-backend"), "etcd, etcd-v2, etcd-v3: the etcd at --rdzv-endpoint; c10d, "
       "static: an etcd this job hosts on the endpoint's node \\[default: etcd with --rdzv-endpoint, else static].",
       RDZV, metavar="NAME",
       fills=RENDEZVOUS_FIELDS, joint=True),
    _t("rdzv_endpoint", _both("--rdzv-endpoint"), "etcd: host:port[,host:port...]; c10d/static: HOST:PORT the "
       "job's etcd is hosted on.", RDZV, metavar="HOST:PORT", default="", envvars=(job_env.RDZV_ENDPOINT,),
       fills=("rendezvous.rdzv_endpoint", "rendezvous.rdzv_backend", "rendezvous.standalone"), joint=True),
    _t("rdzv_id", (*_both("--rdzv-id"), "--run-id"), "Job id shared by all nodes \\[default: 'default'].", RDZV,
       metavar="ID",
       fills=("rendezvous.rdzv_id",), joint=True),
    _t("rdzv_conf", _both("--rdzv-conf"), "key=value,... (join_timeout, last_call_timeout, close_timeout, "
       "read_timeout, keep_alive_interval, keep_alive_max_attempt, heartbeat_timeout, is_host, protocol, cacert, "
       "cert, key, ...; see docs/cli.md).", RDZV, metavar="K=V,...", default="",
       fills=RDZV_CONF_FIELDS, joint=True),
    _t("standalone", ("--standalone",), "Single node: start a private etcd on a free port for this run (implied "
       "by --nnodes 1 without an endpoint).", RDZV, kind=Kind.FLAG, default=False,
       fills=("rendezvous.standalone", "rendezvous.rdzv_backend", "rendezvous.rdzv_endpoint", "rendezvous.rdzv_id"),
       joint=True),
    _t("max_restarts", _both("--max-restarts"), "Worker-failure restarts for the whole job (node changes do not "
       "count).", ELASTIC, type=Type.INT, metavar="N", default=0, at_least=0,
       fills=("rendezvous.max_restarts",)),
    _t("monitor_interval", _both("--monitor-interval"), "Accepted for torchrun compatibility: worker exits are "
       "noticed at once, not polled.", WORKERS, type=Type.FLOAT, metavar="S", default=0.1, at_least=0,
       fills=("workers.monitor_interval",)),
    _t("start_method", _both("--start-method"), "Accepted: workers are always new processes (as torchrun does "
       "for a script).", WORKERS, choices=("spawn", "fork", "forkserver"), metavar="METHOD", default="spawn",
       fills=("workers.start_method",)),
    _t("event_log_handler", _both("--event-log-handler"), "null or console (dynamic_rendezvous accepted): agent "
       "events go to stderr and etcd (`elasticrun status`).", LOGS, metavar="NAME", default="null",
       fills=("logs.event_log_handler",), convert=run_values.stripped),
    _t("role", ("--role",), "Role name of the workers (ROLE_NAME).", WORKERS, metavar="ROLE", default="default",
       fills=("workers.role",)),
    _t("module", ("-m", "--module"), "Run SCRIPT as a Python module (python -m).", WORKERS, kind=Kind.FLAG,
       default=False,
       fills=("workers.module",), joint=True),
    _t("no_python", _both("--no-python"), "Run SCRIPT as a command, not with python.", WORKERS, kind=Kind.FLAG,
       default=False,
       fills=("workers.no_python",), joint=True),
    _t("run_path", _both("--run-path"), "Run SCRIPT with python (workers are separate interpreters either "
       "way); overrides --no-python and -m.", WORKERS, kind=Kind.FLAG, default=False,
       fills=("workers.module", "workers.no_python"), joint=True),
    _t("log_dir", _both("--log-dir"), "Write worker stdout/stderr files under this directory.", LOGS,
       metavar="DIR",
       fills=("logs.log_dir",)),
    _t("redirects", ("-r", "--redirects"), "Streams kept off the console (files only): 0 none, 1 out, 2 err, "
       "3 both; or per local rank 0:3,1:1.", LOGS, metavar="SPEC", default="0",
       fills=("logs.redirects",)),
    _t("tee", ("-t", "--tee"), "Streams copied to files as well as the console (same syntax).", LOGS,
       metavar="SPEC", default="0",
       fills=("logs.tee",)),
    _t("local_ranks_filter", _both("--local-ranks-filter"), "Show only these local ranks' output on the console "
       "(e.g. 0,1); files keep everything.", LOGS, metavar="R,...", default="",
       fills=("logs.local_ranks_filter",), convert=run_values.ranks_filter),
    _t("duplicate_stdout_filters", _both("--duplicate-stdout-filters"), "Copy the tee'd stdout lines (--tee 1 "
       "or 3) that contain any of these strings to <log dir>/<run>/attempt_<round>/filtered_stdout.log (',,' is "
       "a literal comma).", LOGS, metavar="F,...",
       fills=("logs.duplicate_stdout_filters",), convert=run_values.line_filters),
    _t("duplicate_stderr_filters", _both("--duplicate-stderr-filters"), "The same for stderr (--tee 2 or 3), "
       "into filtered_stderr.log.", LOGS, metavar="F,...",
       fills=("logs.duplicate_stderr_filters",), convert=run_values.line_filters),
    _t("node_rank", _both("--node-rank"), "Group rank this node keeps in every round (static: also picks the "
       "node that hosts the job's etcd, rank 0) \\[default: static 0, else any].", RDZV, type=Type.INT,
       metavar="R", at_least=0,
       fills=("rendezvous.node_rank",)),
    _t("master_addr", _both("--master-addr"), "static: host of node rank 0, where the job's etcd runs.", RDZV,
       metavar="HOST", default="127.0.0.1",
       fills=("rendezvous.rdzv_endpoint",), joint=True),
    _t("master_port", _both("--master-port"), "static: port of the job's etcd on --master-addr \\[default: "
       "29500].", RDZV, type=Type.INT, metavar="PORT", at_least=1, at_most=65535,
       fills=("rendezvous.rdzv_endpoint",), joint=True),
    _t("local_addr", _both("--local-addr"), "Address other nodes reach this one at \\[default: route to etcd].",
       RDZV, metavar="ADDR",
       fills=("rendezvous.local_addr",)),
    _t("logs_specs", _both("--logs-specs"), "torchrun's LogsSpecs entry point: only its default (\"default\"), "
       "the layout elasticrun writes (see --log-dir).", LOGS, metavar="NAME"),
    _t("numa_binding", _both("--numa-binding"), "Bind each worker to CPUs near its GPU (local rank r: GPU r), as "
       "torchrun: node, socket, exclusive (a share of the node's cores) or core-complex (one L3 group).",
       WORKERS, choices=("node", "socket", "exclusive", "core-complex"), metavar="MODE",
       fills=("workers.numa_binding",), convert=run_values.optional),
    _t("signals_to_handle", _both("--signals-to-handle"), "Signals the agent forwards to the workers before "
       "leaving the job.", WORKERS, metavar="SIG,...", default=SIGNALS_DEFAULT,
       fills=("workers.signals_to_handle",), convert=run_values.signal_names),
    _t("shutdown_timeout", _both("--shutdown-timeout"), "Seconds between SIGTERM and SIGKILL for workers "
       "\\[default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30].", ELASTIC, type=Type.FLOAT, metavar="S", at_least=0,
       fills=("workers.shutdown_timeout",), joint=True),
    _t("virtual_local_rank", _both("--virtual-local-rank"), "Each worker sees only its GPU, as device 0: "
       "LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES=its GPU (ELASTICRUN_LOCAL_RANK keeps its place on the node).",
       WORKERS, kind=Kind.FLAG, default=False,
       fills=("workers.virtual_local_rank",)),
)

OWN_OPTIONS: Tuple[Opt, ...] = (
    Opt("node_id", ("--node-id",), "Stable id of this node \\[default: random@host:pid].", RDZV, metavar="ID",
        fills=("rendezvous.node_id",), convert=run_values.node_id),
    Opt("heterogeneous", ("--heterogeneous",), "Allow nodes with different --nproc-per-node.", WORKERS,
        kind=Kind.FLAG, default=False,
        fills=("rendezvous.heterogeneous",)),
    Opt("backend", ("--backend",), "Backend hint for workers (ELASTICRUN_BACKEND) \\[default: nccl on GPU, "
        "else gloo].", WORKERS, metavar="NAME",
        fills=("workers.backend",)),
    Opt("prewarm", ("--prewarm",), "Pre-start worker interpreters (torch imported) during the rendezvous "
        "\\[default: on; --no-prewarm turns it off].", WORKERS, kind=Kind.FLAG, default=True,
        negative=("--no-prewarm",),
        fills=("workers.prewarm",)),
    Opt("inplace", ("--inplace",), "Let workers that opted in (elasticrun.train.InPlace) re-form in place at a "
        "join or a graceful leave instead of restarting \\[default: on; --no-inplace turns it off].", WORKERS,
        kind=Kind.FLAG, default=True, negative=("--no-inplace",),
        fills=("rendezvous.inplace",)),
    Opt("inplace_ready_timeout", ("--inplace-ready-timeout",), "Seconds the survivors of an in-place join keep "
        "training at the old size while the newcomers' workers start (up to et.init()); past it the round "
        "restarts every worker.", WORKERS, type=Type.FLOAT, metavar="S", default=300.0, more_than=0,
        fills=("rendezvous.inplace_ready_timeout",)),
    Opt("standby", ("--standby",), "Warm standby interpreters (torch and DDP's modules imported) per node: "
        "1 is a fork server every worker of every round is forked from in milliseconds, its memory shared "
        "with the workers; where forking is unsafe, up to N spawned ones; 0: none.", WORKERS,
        type=Type.INT, metavar="N", default=1, at_least=0, range_note="0 turns standby interpreters off",
        fills=("workers.standby",)),
    Opt("heartbeat_timeout", ("--heartbeat-timeout",), "Seconds without heartbeat before a node counts as dead "
        "(etcd lease TTL).", ELASTIC, type=Type.FLOAT, metavar="S", default=5.0, at_least=2,
        range_note="etcd leases need at least 2 seconds",
        fills=("rendezvous.heartbeat_timeout",)),
    Opt("stability_window", ("--stability-window",), "Seconds to wait for more joiners before (re)forming a "
        "round.", ELASTIC, type=Type.FLOAT, metavar="S", default=1.0, at_least=0,
        fills=("rendezvous.stability_window",)),
    Opt("rescale_timeout", ("--rescale-timeout",), "Seconds to wait for MIN nodes after losing some.", ELASTIC,
        type=Type.FLOAT, metavar="S", default=60.0, at_least=0,
        fills=("rendezvous.rescale_timeout",)),
    Opt("join_timeout", ("--join-timeout",), "Seconds to wait for MIN nodes at the start.", ELASTIC,
        type=Type.FLOAT, metavar="S", default=600.0, at_least=0,
        fills=("rendezvous.join_timeout",)),
    Opt("lr_scaling", ("--lr-scaling",), "LR adaptation hint for workers (ELASTICRUN_LR_SCALING).", ELASTIC,
        choices=("linear", "sqrt", "none"), metavar="HOW", default="linear",
        fills=("workers.lr_strategy",), convert=run_values.member_of(AdaptationStrategy)),
    Opt("redistribution", ("--redistribution",), "What ElasticDistributedSampler does with the rest of the epoch "
        "on a rescale: incremental keeps its order, full reshuffles it (ELASTICRUN_REDISTRIBUTION).", ELASTIC,
        choices=("full", "incremental"), metavar="HOW", default="incremental",
        fills=("workers.redistribution",), convert=run_values.member_of(RedistributionType)),
    Opt("global_batch_size", ("--global-batch-size",), "Global batch elasticrun.train keeps at any world size "
        "with gradient accumulation (ELASTICRUN_GLOBAL_BATCH_SIZE; 0: none).", ELASTIC, type=Type.INT, metavar="N",
        default=0, at_least=0, range_note="0: none",
        fills=("workers.global_batch_size",)),
    Opt("restart_window", ("--restart-window",), "Count --max-restarts within this sliding window (1h, 30m, "
        "600s): at most N restarts in any such window (0: the whole job).", ELASTIC, metavar="DURATION",
        default="0",
        fills=("rendezvous.restart_window",), convert=run_values.window),
    Opt("snapshot_memory", ("--snapshot-memory",), "Cap on this node's shared memory for memory snapshots "
        "(bytes, or 512MB, 8GiB: GB = 10⁹ bytes, GiB = 2³⁰; ELASTICRUN_SNAPSHOT_MEMORY) \\[default: half of "
        "/dev/shm, at most half of the container's memory limit].", ELASTIC,
        metavar="SIZE", envvars=(job_env.SNAPSHOT_MEMORY,),
        fills=("memory.snapshot_memory",), convert=run_values.snapshot_memory),
    Opt("snapshots", ("--snapshots",), "Give workers a memory tier for snapshots (a private /dev/shm directory "
        "the agent owns) \\[default: on; --no-snapshots turns it off].", ELASTIC, kind=Kind.FLAG, default=True,
        negative=("--no-snapshots",),
        fills=("memory.snapshots",)),
    Opt("hang_timeout", ("--hang-timeout",), "Restart the round when the step the workers report "
        "(elasticrun.train.heartbeat / ProgressReporter) has not advanced for S seconds, after dumping every "
        "worker's Python stacks into the log (ELASTICRUN_HANG_TIMEOUT; 0: off).", ELASTIC, type=Type.FLOAT,
        metavar="S", default=0.0, envvars=(job_env.HANG_TIMEOUT,), at_least=0, range_note="0 turns it off",
        fills=("health.hang_timeout",)),
    Opt("node_check", ("--node-check",), "Check this node (as `elasticrun check` does) before it joins the job; "
        "a node that fails stays out, with the reason in its log, `status` and events, and exits 6 "
        "\\[default: off].", ELASTIC, kind=Kind.FLAG, default=False,
        fills=("health.node_check",)),
    Opt("node_check_thresholds", ("--node-check-thresholds",), "Thresholds of --node-check other than the "
        "defaults, as NAME=N,... with the names of `elasticrun check`'s flags (min-cpu-gflops=20,"
        "max-gpu-temp-c=80).", ELASTIC, metavar="LIST", default="",
        fills=("health.node_check_thresholds",), convert=run_values.thresholds),
    Opt("straggler_threshold", ("--straggler-threshold",), "A rank whose compute time per step (reported with "
        "elasticrun.train.StepTimer) is at least this many times the job's median, and 1 ms or more above it, is "
        "slow.", ELASTIC,
        type=Type.FLOAT, metavar="X", default=1.2, more_than=1,
        fills=("health.straggler_threshold",)),
    Opt("straggler_window", ("--straggler-window",), "Seconds a rank must stay slow to be flagged as a straggler "
        "(and fast again to be cleared).", ELASTIC, type=Type.FLOAT, metavar="S", default=30.0, more_than=0,
        fills=("health.straggler_window",)),
    Opt("straggler_action", ("--straggler-action",), "What the leader does about a straggler: warn (status, "
        "events, metrics) or drain (its node also leaves the job gracefully and stays out until restarted).",
        ELASTIC, choices=("warn", "drain"), metavar="HOW", default="warn",
        fills=("health.straggler_action",), convert=run_values.member_of(StragglerAction)),
    Opt("metrics_port", ("--metrics-port",), "Serve Prometheus/OpenMetrics /metrics on this port (world size, "
        "step, goodput, restarts...; docs/observability.md; 0: off).", LOGS, type=Type.INT, metavar="PORT",
        default=0, envvars=(job_env.METRICS_PORT,), at_least=0, at_most=65535, range_note="0: no metrics",
        fills=("logs.metrics_port",)),
    Opt("metrics_host", ("--metrics-host",), "Address /metrics listens on (0.0.0.0: every interface).", LOGS,
        metavar="ADDR", default="127.0.0.1", envvars=(job_env.METRICS_HOST,),
        fills=("logs.metrics_host",), convert=run_values.host),
    Opt("events_file", ("--events-file",), "Append the agent's events (rounds, restarts, rescales, checkpoints, "
        "outages) to this file as JSON lines (created 0600; a link or another user's file is refused).", LOGS,
        metavar="PATH", envvars=(job_env.EVENTS_FILE,),
        fills=("logs.events_file",), convert=run_values.optional),
    Opt("quiet", ("-q", "--quiet"), "No agent progress lines.", LOGS, kind=Kind.FLAG, default=False,
        fills=("logs.quiet",)),
    Opt("etcd_binary", ("--etcd-binary",), "etcd executable for an etcd this node starts.", ETCD,
        metavar="PATH",
        fills=("etcd.etcd_binary",)),
    Opt("etcd_timeout", ("--etcd-timeout",), "Seconds to keep retrying an unreachable etcd before giving up.",
        ETCD, type=Type.FLOAT, metavar="S", default=10.0, envvars=(job_env.ETCD_TIMEOUT,), more_than=0,
        fills=("etcd.etcd_timeout",)),
    Opt("ended_job_ttl", ("--ended-job-ttl",), "How long the keys of an ended job (its settings, command line, "
        "state, rounds) stay in etcd, for `elasticrun status` to show its outcome: 1h, 30m, 7d (0: forever; "
        "never with --standalone or a hosted etcd, which go with the job).", ETCD, metavar="DURATION",
        default="7d",
        fills=("etcd.ended_job_ttl",), convert=run_values.ttl),
    Opt("etcd_outage_grace", ("--etcd-outage-grace",), "Seconds workers keep training while etcd is unreachable "
        "(then they get SIGTERM and --shutdown-timeout to save).", ETCD, type=Type.FLOAT, metavar="S",
        default=60.0, at_least=0,
        fills=("etcd.etcd_outage_grace",)),
)


def _etcd_connection_options() -> Tuple[Opt, ...]:
    """The etcd connection flags of :data:`elasticrun.cli.etcd_options.FLAGS`, in their order."""
    return tuple(Opt(dest=f.dest, names=(f.flag,), help=f.help, panel=ETCD, default=None, metavar="VALUE",
                     envvars=(f.envvar,), fills=(f"etcd.{f.dest}",)) for f in etcd_options.FLAGS)


def all_options() -> Tuple[Opt, ...]:
    """Every option of ``elasticrun run``: torchrun's, then elasticrun's, then the etcd connection ones."""
    own = {o.dest for o in TORCHRUN_OPTIONS + OWN_OPTIONS}
    return TORCHRUN_OPTIONS + OWN_OPTIONS + tuple(o for o in _etcd_connection_options() if o.dest not in own)


def by_name(options: Tuple[Opt, ...]) -> Dict[str, Tuple[Opt, bool]]:
    """Every spelling → (option, value it sets for a FLAG: True, or False for a ``negative`` one)."""
    table: Dict[str, Tuple[Opt, bool]] = {}
    for opt in options:
        for name in opt.names:
            table[name] = (opt, True)
        for name in opt.negative:
            table[name] = (opt, False)
    return table
