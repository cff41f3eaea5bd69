"""Hostile inputs: every parser of outside data, fuzzed with hypothesis and pinned by regression
tests. metadata.json, safetensors headers and CLI values end in one CheckpointError / one
clear line; etcd records written by other agents are logged and ignored. Never a traceback,
a hang or a partial write. Real files (and a real etcd for the records)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticrun.checkpoint import CheckpointError, list_checkpoints, load, save
from elasticrun.checkpoint.checksum import Checksum, digest_of
from elasticrun.checkpoint.format import CheckpointMeta
from elasticrun.checkpoint.shardfile import read_header
from elasticrun.cli.main import main as cli_main
from elasticrun.job import records
from elasticrun.job.requests import answer_record, request_record
from elasticrun.rendezvous.records import (
    event_record,
    loads_record,
    node_record,
    parse_node,
    parse_topology,
    topology_record,
)

from helpers.ckpt import cli

pytestmark = pytest.mark.integration  # starts etcd or processes

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
FUZZ_CLI = settings(FUZZ, max_examples=25)  # each run builds the typer app (~0.4 s)
SHARD = "shard-00000-of-00001.safetensors"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A real checkpoint (two tensors, one file) to mutate copies of."""
    root = tmp_path_factory.mktemp("good")
    save({"a": torch.arange(6.0).view(2, 3), "b": torch.arange(4, dtype=torch.int64)}, root, "x",
         training_state={"step": 3})
    return root


def _copy(good: Path, dst: Path) -> Path:
    (dst / "x").mkdir(parents=True, exist_ok=True)
    for f in os.listdir(good / "x"):
        (dst / "x" / f).write_bytes((good / "x" / f).read_bytes())
    return dst


def _only_checkpoint_errors(fn):
    try:
        return fn()
    except CheckpointError as err:
        assert "\n" not in str(err).strip() or "Traceback" not in str(err)
        return err


# -- metadata.json ---------------------------------------------------------------------------


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _set(doc, path, value):
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


@FUZZ
@given(data=st.data())
def test_fuzzed_metadata_is_listed_and_refused_cleanly(good, tmp_path_factory, data):
    root = _copy(good, tmp_path_factory.mktemp("m"))
    doc = json.loads((good / "x" / "metadata.json").read_text())
    paths = list(_paths(doc))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        try:
            doc = _set(doc, path, data.draw(json_values))
        except (KeyError, IndexError, TypeError):
            pass
    raw = json.dumps(doc).encode()
    (root / "x" / "metadata.json").write_bytes(raw)
    _only_checkpoint_errors(lambda: CheckpointMeta.loads(raw, "m"))
    infos = list_checkpoints(root)  # never raises
    assert [i.dirname for i in infos] == ["x"]
    target = {"a": torch.full((2, 3), 9.0), "b": torch.full((4,), 9, dtype=torch.int64)}
    out = _only_checkpoint_errors(lambda: load(root, "x", state_dict=target))
    if isinstance(out, CheckpointError):
        assert all(bool(torch.all(t == 9)) for t in target.values())  # no partial write


@FUZZ
@given(raw=st.binary(max_size=200))
def test_metadata_bytes_never_escape_as_anything_but_checkpoint_error(raw):
    _only_checkpoint_errors(lambda: CheckpointMeta.loads(raw, "m"))


def test_a_deeply_nested_metadata_does_not_break_listing_the_root(good, tmp_path):
    root = _copy(good, tmp_path)
    save({"w": torch.ones(1)}, root, "fine")
    (root / "x" / "metadata.json").write_bytes(b"[" * 100000 + b"]" * 100000)
    infos = {i.name: i for i in list_checkpoints(root)}
    assert infos["x"].status == "corrupt" and "nested too deeply" in infos["x"].problem
    assert infos["fine"].latest
    res = cli("list", str(root), "--json")
    assert res.returncode == 0 and "Traceback" not in res.stderr
    with pytest.raises(CheckpointError, match="nested too deeply"):
        load(root, "x")


def test_a_deep_state_dict_tree_is_refused(good, tmp_path):
    root = _copy(good, tmp_path)
    doc = json.loads((root / "x" / "metadata.json").read_text())
    tree = {"__tensor__": "a"}
    for _ in range(500):
        tree = {"k": tree}
    doc["tree"] = tree
    (root / "x" / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="nested deeper"):
        load(root, "x")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_non_regular_metadata_file_does_not_hang_listing(good, tmp_path, kind):
    root = _copy(good, tmp_path)
    meta = root / "x" / "metadata.json"
    meta.unlink()
    if kind == "fifo":
        os.mkfifo(meta)
    else:
        meta.symlink_to("/dev/zero")
    res = cli("list", str(root), "--json", timeout=60)  # today's code hangs here (TimeoutExpired)
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout)[0]
    assert row["status"] == "corrupt" and "not a regular file" in row["problem"]
    res = cli("verify", str(root), "x", timeout=60)
    assert res.returncode == 5 and "not a regular file" in res.stderr and "Traceback" not in res.stderr


def test_a_non_regular_shard_file_is_refused(good, tmp_path):
    root = _copy(good, tmp_path)
    (root / "x" / SHARD).unlink()
    os.mkfifo(root / "x" / SHARD)
    res = cli("verify", str(root), "x", timeout=60)
    assert res.returncode == 5 and "not a regular file" in res.stderr
    assert list_checkpoints(root)[0].status == "corrupt"


def test_an_oversized_metadata_file_is_refused_without_reading_it(good, tmp_path, monkeypatch):
    from elasticrun.checkpoint import validate

    root = _copy(good, tmp_path)
    monkeypatch.setattr(validate, "MAX_METADATA_BYTES", 100)
    with pytest.raises(CheckpointError, match="larger than"):
        load(root, "x")


# -- safetensors headers ---------------------------------------------------------------------


def _rewrite_shard(root: Path, mutate) -> None:
    """Rewrite the shard's header with ``mutate(header)`` and update metadata.json to match, so
    only the header is hostile (the checksum is right)."""
    path = root / "x" / SHARD
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    header = mutate(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    new = struct.pack("<Q", len(raw)) + raw + body
    path.write_bytes(new)
    meta_path = root / "x" / "metadata.json"
    doc = json.loads(meta_path.read_text())
    algo = Checksum.CRC32 if "crc32" in doc["files"][SHARD] else Checksum.SHA256
    doc["files"][SHARD].update({"size": len(new), algo.value: digest_of(algo, new)})
    meta_path.write_text(json.dumps(doc))


def test_negative_data_offsets_never_read_header_bytes_as_data(good, tmp_path):
    root = _copy(good, tmp_path)

    def negative(h):
        for k, v in h.items():
            if k == "b":  # 32 bytes of int64: point them 32 bytes back, into the header
                a, b = v["data_offsets"]
                v["data_offsets"] = [a - 10_000, b - 10_000] if a >= 10_000 else [-32, 0]
        return h

    _rewrite_shard(root, negative)
    for verify in (True, False):
        with pytest.raises(CheckpointError, match="data_offsets"):
            load(root, "x", verify=verify)


def test_a_huge_header_length_prefix_is_refused(good, tmp_path):
    root = _copy(good, tmp_path)
    path = root / "x" / SHARD
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 2 ** 63)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header length"):
        load(root, "x", verify=False)
    with open(path, "rb") as f:
        with pytest.raises(CheckpointError, match="header length"):
            read_header(f, "f")


@FUZZ
@given(data=st.data())
def test_fuzzed_shard_headers_end_in_checkpoint_errors(good, tmp_path_factory, data):
    root = _copy(good, tmp_path_factory.mktemp("h"))

    def mutate(h):
        key = data.draw(st.sampled_from(["a", "b", "__metadata__", "zz"]))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
        value = data.draw(json_values | st.lists(st.integers(-(2 ** 65), 2 ** 65), max_size=3))
        if field is None or not isinstance(h.get(key), dict):
            h[key] = value
        else:
            h[key][field] = value
        return h

    _rewrite_shard(root, mutate)
    target = {"a": torch.full((2, 3), 9.0), "b": torch.full((4,), 9, dtype=torch.int64)}
    out = _only_checkpoint_errors(lambda: load(root, "x", state_dict=target, verify=data.draw(st.booleans())))
    if isinstance(out, CheckpointError):
        assert all(bool(torch.all(t == 9)) for t in target.values())
    else:
        assert torch.equal(target["a"], torch.arange(6.0).view(2, 3)) and torch.equal(target["b"], torch.arange(4))


@FUZZ
@given(raw=st.binary(max_size=64))
def test_raw_shard_bytes_end_in_checkpoint_errors(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("r") / "f"
    path.write_bytes(raw)
    with open(path, "rb") as f:
        _only_checkpoint_errors(lambda: read_header(f, "f", len(raw)))


# -- CLI values ------------------------------------------------------------------------------


def _run_cli(capsys, *args: str) -> int:
    try:
        cli_main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "Traceback" not in out.out
    return code


@FUZZ_CLI
@given(name=st.text(max_size=30), keep=st.integers(-(2 ** 40), 2 ** 40), cmd=st.sampled_from(
    ["inspect", "verify", "delete", "delete-keep", "list"]))
def test_fuzzed_ckpt_cli_values_end_in_one_clear_line(good, tmp_path_factory, capsys, name, keep, cmd):
    root = str(_copy(good, tmp_path_factory.mktemp("c")))
    if cmd == "delete-keep":
        args = ["ckpt", "delete", root, "--keep-last", str(keep), "--yes"]
    elif cmd == "list":
        args = ["ckpt", "list", os.path.join(root, name.replace("\0", "")), "--json"]
    elif cmd == "delete":
        args = ["ckpt", "delete", root, name, "--yes"]
    else:
        args = ["ckpt", cmd, root, name, "--json"]
    code = _run_cli(capsys, *args)
    assert code in (0, 1, 2, 5)
    if name != "x":
        assert (Path(root) / "x" / "metadata.json").is_file()  # nothing but what was named is ever touched


# -- etcd records from other agents ----------------------------------------------------------


@FUZZ
@given(value=json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64))
def test_fuzzed_etcd_records_are_parsed_or_ignored(value):
    loads_record(value)
    node, topo = parse_node(value), parse_topology(value)
    assert node is None or (isinstance(node.nproc, int) and node.nproc > 0)
    assert topo is None or all(isinstance(m.nproc, int) for m in topo.members)


@FUZZ
@given(field=st.sampled_from(["node_id", "host", "addr", "nproc", "pid", "status", "store_port", "waiting_for"]),
       value=json_values)
def test_a_node_record_with_one_bad_field_is_ignored_or_sane(field, value):
    rec = {"node_id": "n1", "host": "h", "addr": "127.0.0.1", "nproc": 2, "pid": 1}
    rec[field] = value
    node = parse_node(json.dumps(rec).encode())
    if node is not None:
        assert isinstance(node.host, str) and isinstance(node.nproc, int) and node.nproc > 0


def test_a_view_survives_garbage_written_by_another_agent(etcd, job_id):
    from elasticrun.job.keys import JobKeys
    from elasticrun.rendezvous.view import JobView

    keys = JobKeys(job_id)
    good_node = {"node_id": "n1", "host": "h", "addr": "127.0.0.1", "nproc": 2, "pid": 1}
    etcd.put(keys.nodes + "n1", json.dumps(good_node))
    etcd.put(keys.nodes + "evil", b"[" * 100000)
    etcd.put(keys.nodes + "evil2", json.dumps({"node_id": "e", "host": "h", "addr": "a", "nproc": "many", "pid": 1}))
    etcd.put(keys.topology, json.dumps({"round": 1, "members": [{"node_id": 3}], "master_addr": "a",
                                        "master_port": 1}))
    etcd.put(keys.state, b"\xff\xfe not json")
    view = JobView(etcd, keys)
    try:
        assert set(view.nodes()) == {"n1"}
        assert view.topology()[0] is None and view.state() is None
        good_topo = {"round": 2, "members": [{"node_id": "n1", "host": "h", "addr": "a", "nproc": 2,
                                              "group_rank": 0, "rank_offset": 0}],
                     "master_addr": "a", "master_port": 1}
        etcd.put(keys.topology, json.dumps(good_topo))
        from helpers.procs import wait_until

        wait_until(lambda: view.topology()[0] is not None, 10, "the good topology")
        etcd.put(keys.topology, b"{not json")
        wait_until(lambda: view.get(keys.topology).value == b"{not json", 10, "the bad topology")
        assert view.topology()[0].round == 2  # the last good round is kept, the bad record ignored
    finally:
        view.close()


# -- every record type read from etcd: checked at one boundary (elasticrun/job/records.py) ------------

GOOD_RECORDS = {  # a valid record of each type, as its writer writes it
    "config": (records.config_record, {"nnodes": "1:2", "args": ["x"], "max_restarts": 3}),
    "state": (records.state_record, {"state": "failed", "reason": "r", "round": 2, "time": 1.5, "exit_code": 138}),
    "failed": (records.failed_flag, {"node": "a", "rank": 0, "time": 1.0}),
    "end": (records.end_flag, {"reason": "scale-up", "by": "a", "lost": "b", "time": 2.0}),
    "done": (records.time_mark, {"time": 3.0}),
    "joining": (records.joining_flag, {"nodes": ["c"]}),
    "failures": (records.failure_rows, [{"node_id": "a", "host": "h", "rank": 0, "local_rank": 0, "exitcode": 3,
                                         "signal": None, "message": "m", "traceback": "", "timestamp": 1.0,
                                         "stderr_tail": ""}]),
    "restarts": (records.restart_history, {"times": [1.0, 2.5]}),
    "progress": (records.progress_record, {"step": 7, "loss": 0.5, "samples_per_s": None, "rank": 0, "round": 1,
                                           "world_size": 2, "time": 9.0, "stalls": {"checkpoint": [1, 0.5, 0.5]},
                                           "compute": {"0": 0.25}}),
    "goodput": (records.goodput_record, {"wall_s": 10.0, "goodput_s": 8.0, "goodput_ratio": 0.8, "steps_lost": 0,
                                         "badput_s": {"restart": 2.0}, "phase_s": {"training": 8.0}}),
    "expiry": (records.expiry_record, {"lease": 12345, "ttl": 60, "time": 1.0}),
    "stragglers": (records.straggler_record, {"round": 2, "time": 1.0, "threshold": 1.2, "window_s": 30.0,
                                              "median_s": 0.1, "ranks": {"1": {"node": "b", "compute_s": 0.3,
                                                                                "ratio": 3.0, "straggler": True,
                                                                                "slow_since": 0.5}},
                                              "nodes": {"b": 3.0}, "drain": ["b"]}),
    "excluded": (records.excluded_record, {"reason": "r", "why": "straggler", "time": 1.0, "checks": []}),
    "request": (request_record, {"request_id": "r1", "requested_at": 5.0}),
    "answer": (answer_record, {"name": "step-1", "root": "/ckpt", "step": 1}),
    "node": (node_record, {"node_id": "n1", "host": "h", "addr": "127.0.0.1", "nproc": 2, "pid": 1,
                           "status": "Active", "waiting_for": -1, "store_port": 29500, "accelerators": []}),
    "topology": (topology_record, {"round": 1, "members": [{"node_id": "n1", "host": "h", "addr": "a", "nproc": 2,
                                                            "group_rank": 0, "rank_offset": 0, "lease": 7}],
                                   "master_addr": "a", "master_port": 1, "restart_count": 0, "created_at": 1.0}),
    "event": (event_record, {"type": "ScaleUp", "round": 1, "old_members": ["a"], "new_members": ["a", "b"],
                             "old_world_size": 1, "new_world_size": 2, "reason": "r", "restart_count": 0,
                             "time": 1.0}),
}
raw_records = json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64)


def test_every_good_record_passes_its_check_and_keeps_its_types():
    for name, (check, good) in GOOD_RECORDS.items():
        got = records.parse(name, json.dumps(good).encode(), check)
        assert got is not None, name
        if isinstance(good, dict) and not isinstance(got, list):
            for field, value in good.items():
                seen = got.get(field) if isinstance(got, dict) else getattr(got, field)
                assert value is None or _kind(seen) == _kind(value), (name, field, seen)


@FUZZ
@given(name=st.sampled_from(sorted(GOOD_RECORDS)), value=raw_records)
def test_any_value_is_checked_or_reported_never_raised(name, value):
    records.parse(f"/elasticrun/j/{name}", value, GOOD_RECORDS[name][0])  # a value or None: never an exception


def _kind(v):
    for kind, types in (("bool", bool), ("number", (int, float)), ("str", str), ("list", (list, tuple)),
                        ("dict", dict)):
        if isinstance(v, types):
            return kind
    return type(v).__name__


@FUZZ
@given(name=st.sampled_from(sorted(set(GOOD_RECORDS) - {"config"})), data=st.data())
def test_a_record_with_one_bad_field_is_refused_or_keeps_its_types(name, data):
    check, good = GOOD_RECORDS[name]
    doc = json.loads(json.dumps(good))
    path = data.draw(st.sampled_from(list(_paths(doc))))
    try:
        doc = _set(doc, path, data.draw(json_values))
    except (KeyError, IndexError, TypeError):
        return
    got = records.parse(f"/elasticrun/j/{name}", json.dumps(doc).encode(), check)
    if got is None or not isinstance(good, dict):
        return
    for field, value in good.items():  # every known field kept its type (or is absent/null where allowed)
        seen = got.get(field) if isinstance(got, dict) else getattr(got, field, None)
        if seen is not None and value is not None and not (field == "members" or isinstance(got, list)):
            assert _kind(seen) == _kind(value), (field, seen)


def test_a_bad_record_is_reported_once_with_its_key_and_problem(caplog):
    key = "/elasticrun/j/state-once-test"
    with caplog.at_level("WARNING", logger="elasticrun.records"):
        for _ in range(3):
            assert records.parse(key, b'{"state": 5}', records.state_record) is None
    lines = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert lines == [f"elasticrun: ignoring a malformed record in etcd at {key}: field 'state': expected a string, "
                     "got 5"]


def _status_of(kvs):
    import io

    from rich.console import Console

    from elasticrun.cli.goodput_view import with_goodput
    from elasticrun.cli.status_render import render_job
    from elasticrun.rendezvous.jobstatus import build_job_status, job_phase
    from elasticrun.store.types import KeyValue

    doc = build_job_status("j", [KeyValue(k, v, i + 1, i + 1, 0) for i, (k, v) in enumerate(kvs)])
    doc["phase"] = job_phase(doc)
    with_goodput(doc)
    Console(file=io.StringIO(), width=100).print(render_job(doc, "etcd:2379"))
    return doc


@FUZZ
@given(slot=st.sampled_from(["config", "state", "topology", "nodes/n1", "progress/n1", "goodput/n1",
                             "rounds/00000001/failed", "rounds/00000001/end", "rounds/00000001/failures/n1",
                             "events/00000001", "expiry"]), value=raw_records)
def test_status_shows_a_job_whatever_one_of_its_records_holds(slot, value):
    from elasticrun.job.keys import JobKeys

    keys = JobKeys("j")
    good = {keys.config: GOOD_RECORDS["config"][1], keys.topology: GOOD_RECORDS["topology"][1],
            keys.node("n1"): GOOD_RECORDS["node"][1], keys.progress_of("n1"): GOOD_RECORDS["progress"][1],
            keys.goodput_of("n1"): GOOD_RECORDS["goodput"][1], keys.event(1): GOOD_RECORDS["event"][1]}
    kvs = {k: json.dumps(v).encode() for k, v in good.items()}
    kvs[keys.prefix + slot] = value
    doc = _status_of(sorted(kvs.items()))
    assert doc["phase"] in ("forming", "running", "rescaling", "succeeded", "failed", "stopped")


@FUZZ
@given(value=raw_records)
def test_the_hang_watch_and_a_checkpoint_request_take_any_progress_or_request_value(value):
    from elasticrun.job.requests import parse_request
    from elasticrun.launch.hang import HangWatch

    watch = HangWatch(lambda: records.parse("p", value, records.progress_record), 1.0, clock=lambda: 0.0)
    watch.start_round(0)
    watch.poll()
    rid, at = parse_request("/elasticrun/j/control/checkpoint/r9", value)
    assert rid == "r9" and isinstance(at, float)
