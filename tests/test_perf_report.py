"""scripts/perf/perf_report.py (summary table between the page's markers, charts) and run_all.py's helpers,
fed small synthetic bench results."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
FOLDER = {"perf_report": "perf", "run_all": "bench"}  # the script's folder under scripts/
PAGE = ("# Performance\n\nintro stays\n\n<!-- summary:begin -->\nold table\n<!-- summary:end -->\n\n"
        "## Charts\n\nend stays\n")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / FOLDER[name] / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pr():
    return _load("perf_report")


def _entry(metric, er, alt, alt_value, better="lower", unit="s", ratio=None):
    return dict(metric=metric, elasticrun=er, alternative=alt, alt_value=alt_value, unit=unit, better=better,
                ratio=ratio, device="cpu", command="python scripts/bench/bench_x.py --runs 1")


def _manifest(d: Path, benches) -> None:
    """run_all.py's bench_all.json: ``benches`` are (name, status, json file or None, notes)."""
    rows = [{"name": n, "script": f"bench_{n.split('-')[0]}.py", "command": f"python scripts/bench_{n}.py",
             "status": st, "seconds": 1.0, "returncode": 0 if st == "ok" else None, "json": js, "log": f"{n}.log",
             "notes": notes} for n, st, js, notes in benches]
    (d / "bench_all.json").write_text(json.dumps({"preset": "quick", "device": "cpu", "started": 1.7e9,
                                                  "host": {"cpus": 2, "loadavg_start": [3.5]}, "benches": rows}))


def _compare(state: str, size: int, scale: float) -> dict:
    """A bench_checkpoint.py JSON: its interleaved comparison's seconds per round, label by label."""
    runs = {"disk: cold sequential read (dd, fresh file)": [0.2], "elasticrun save (durable)": [0.5, 0.4, 0.6],
            "elasticrun load into existing tensors (cold)": [0.25], "safetensors save (durable)": [0.8],
            "safetensors load into existing tensors (cold)": [0.5], "elasticrun async save: training stall": [0.01],
            "elasticrun load, verify=False, into existing tensors (cold)": [0.2]}
    return {"summary": [], "compare": {"state": state, "device": "cpu", "size_bytes": size,
                                       "runs": {k: [x * scale for x in v] for k, v in runs.items()}}}


def _results(d: Path) -> Path:
    """A run_all.py output dir: every bench kind as it writes its JSON, a failed bench, a missing file."""
    d.mkdir()
    launch_runs = [
        {"launcher": "elasticrun", "scenario": "launch", "outcome": "ok", "seconds": t, "crash_after": None,
         "phases": {"etcd up": t / 4, "round 0": t / 2}} for t in (4.0, 3.0, 5.0)
    ] + [{"launcher": "torchrun-best", "scenario": "launch", "outcome": "hang", "seconds": None, "crash_after": None,
          "phases": {}}] + [{"launcher": "elasticrun", "scenario": "restart", "outcome": "ok", "seconds": s,
                              "crash_after": at, "phases": {}} for s, at in ((1.0, 1.0), (0.8, 5.0))]
    (d / "launch.json").write_text(json.dumps({"runs": launch_runs, "summary": [
        _entry("launch -> first step", 2.0, "torchrun-best", 3.0, ratio=1.5),
        _entry("crash -> first step", 5.0, "torchrun-best", 4.0, ratio=0.8),
        _entry("load bandwidth", 2.0, "safetensors", 1.6, better="higher", unit="GB/s", ratio=1.25),
        _entry("no alternative", 1.0, "none", None, ratio=None),
        _entry("stall", 0.1, "disk save", 3.0, ratio=30.0), _entry("stall", 0.1, "DCP save", 1.5, ratio=15.0),
    ]}))
    (d / "elastic.json").write_text(json.dumps({"summary": [], "results": [
        {"scenario": "join", "variant": "elasticrun sw=1 prewarm", "client": "bench", "outcomes": [
            {"status": "ok", "seconds": 4.0}, {"status": "ok", "seconds": 6.0}, {"status": "hang", "seconds": None}]},
        {"scenario": "join", "variant": "torchrun c10d tuned", "client": "bench", "outcomes": [
            {"status": "ok", "seconds": 8.0}, {"status": "ok", "seconds": 9.0}]},
        {"scenario": "kill", "variant": "elasticrun hb=3 prewarm", "client": "bench",
         "outcomes": [{"status": "ok", "seconds": 3.0}]},
        {"scenario": "kill", "variant": "torchrun c10d default", "client": "bench",
         "outcomes": [{"status": "hang", "seconds": None}]},
    ]}))
    (d / "checkpoint-0.5.json").write_text(json.dumps(_compare("uniform", 1 << 29, 1.0)))
    (d / "checkpoint-1.json").write_text(json.dumps(_compare("uniform", 1 << 30, 2.0)))
    (d / "checkpoint-0.4.json").write_text(json.dumps(_compare("gpt", 4 * 10**8, 1.0)))
    (d / "rendezvous.json").write_text(json.dumps({"summary": [], "cpus": 2, "command": "python x", "rows": [
        {"phase": phase, "nodes": n, "all_hold_s": n / 100, "cpu_per_agent_ms": 3.0, "etcd_cpu_s": n / 300,
         "etcd_writes": 3 * n, "load": 1.5} for n in (8, 32, 128) for phase in ("round 0", "loss")]}))
    (d / "elastic-join3.json").write_text(json.dumps({"results": [], "summary": [
        _entry("crash -> first step", 7.0, "torchrun tuned", 14.0, ratio=2.0)]}))
    (d / "stale.json").write_text(json.dumps({"summary": [_entry("not in this run", 1.0, "x", 1.0)]}))
    names = ["launch", "elastic", "elastic-join3", "checkpoint-0.4", "checkpoint-0.5", "checkpoint-1", "rendezvous"]
    _manifest(d, [(n, "ok", f"{n}.json", []) for n in names]
              + [("snapshot", "timeout", None, ["stopped after 180 s"]), ("gone", "ok", "gone.json", [])])
    return d


def test_table_between_markers_and_rerun_in_place(pr, tmp_path, capsys):
    d = _results(tmp_path / "res")
    page = tmp_path / "performance.md"
    page.write_text(PAGE)
    assert pr.main([str(d), "--page", str(page), "--no-plots"]) == 0
    text = page.read_text()
    assert text.startswith("# Performance\n\nintro stays\n\n<!-- summary:begin -->\n")
    assert text.endswith("<!-- summary:end -->\n\n## Charts\n\nend stays\n")
    assert "old table" not in text
    body = text.split("<!-- summary:begin -->")[1].split("<!-- summary:end -->")[0]
    lines = {ln.split(" | ")[0].lstrip("| "): ln for ln in body.splitlines() if ln.startswith("| ")}
    assert "| metric | elasticrun | best alternative | ratio | device | command |" in body
    assert "`--preset quick`" in body and "2 CPUs" in body and "load average 3.5" in body
    # the contract: the ratio as the bench wrote it (> 1 bold), none without an alternative
    assert "**1.50×**" in lines["launch -> first step"] and "torchrun-best: 3 s" in lines["launch -> first step"]
    assert "| 0.80× |" in lines["crash -> first step [launch]"]
    assert "**1.25×**" in lines["load bandwidth"] and "2 GB/s" in lines["load bandwidth"]
    assert lines["no alternative"].endswith("| 1 s | none | — | cpu | `python scripts/bench/bench_x.py --runs 1` |")
    assert "`python scripts/bench/bench_x.py --runs 1`" in lines["launch -> first step"]
    # several alternatives for one figure: the strongest stays, once
    assert "DCP save (strongest of 2): 1.5 s" in lines["stall"] and "**15.00×**" in lines["stall"]
    assert body.count("| stall |") == 1
    # the same metric name from two runs is not merged: each says which run it is
    assert "**2.00×**" in lines["crash -> first step [elastic-join3]"] and "crash -> first step" not in lines
    # what is not in the table is said under it; files not in the manifest are not read
    assert "snapshot: timeout (stopped after 180 s)" in body
    assert "gone.json: listed in bench_all.json but missing" in body
    assert "not in this run" not in body
    # a rerun replaces the block, it does not add one
    assert pr.main([str(d), "--page", str(page), "--no-plots"]) == 0
    assert page.read_text() == text
    assert text.count("<!-- summary:begin -->") == 1


def test_commands_on_the_page_lose_the_run_dir(pr):
    command = "python b.py --out /tmp/run/r.json --json=/tmp/run/j.json"
    row = dict(metric="m", elasticrun=1.0, alternative="x", alt_value=2.0, unit="s", ratio=2.0, device="cpu",
               command=command)
    assert "`python b.py --out r.json --json=j.json`" in pr.table([row])


def test_bad_input_is_one_line_and_leaves_the_page(pr, tmp_path, capsys):
    d = _results(tmp_path / "res")
    page = tmp_path / "p.md"
    page.write_text("# no markers here\n")
    assert pr.main([str(d), "--page", str(page), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "<!-- summary:begin -->" in err
    assert page.read_text() == "# no markers here\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert pr.main([str(empty), "--page", str(page), "--no-plots"]) == 2
    assert "cannot read" in capsys.readouterr().err  # no bench_all.json: not a run_all.py dir
    _manifest(empty, [("launch", "failed", None, [])])
    assert pr.main([str(empty), "--page", str(page), "--no-plots"]) == 2
    assert "no bench JSON" in capsys.readouterr().err


def test_unreadable_bench_json_is_listed(pr, tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    (d / "checkpoint-x.json").write_text(json.dumps({"summary": [_entry("m", 1.0, "alt", 2.0, ratio=2.0)]}))
    (d / "broken.json").write_text("{not json")
    (d / "other.json").write_text("{}")
    _manifest(d, [(n, "ok", f"{n}.json", []) for n in ("checkpoint-x", "broken", "other")])
    inputs = pr.load_dir(d)
    rows = pr.summary_rows(inputs)
    assert [(r["metric"], r["ratio"], r["device"]) for r in rows] == [("m", 2.0, "cpu")]
    assert inputs.problems == ["broken.json: unreadable (JSONDecodeError)", "other.json: no summary list"]


def test_charts_are_written(pr, tmp_path):
    pytest.importorskip("matplotlib")
    d = _results(tmp_path / "res")
    page = tmp_path / "performance.md"
    page.write_text(PAGE)
    img = tmp_path / "img"
    assert pr.main([str(d), "--page", str(page), "--img-dir", str(img)]) == 0
    for name in ("perf-launch", "perf-recovery", "perf-checkpoint", "perf-rendezvous", "perf-scaleup"):
        png = img / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    data = pr.chart_data(pr.load_dir(d))
    launch = {g["label"]: g for g in data["launch"]}
    assert launch["elasticrun · 1 node"]["phases"] == [("etcd up", 1.0), ("round 0", 2.0)]  # the median run's
    assert launch["torchrun-best · 1 node"]["times"] == [] and launch["torchrun-best · 1 node"]["runs"] == 1
    labels = [g["label"] for g in data["recovery"]]
    assert "elasticrun · worker crash at 1s" in labels and "elasticrun · worker crash at 5s" in labels  # per moment
    assert "elasticrun hb=3 prewarm · bench client · node SIGKILL" in labels
    assert [(g["label"], g["times"], g["runs"]) for g in data["scaleup"]] == [
        ("elasticrun sw=1 prewarm · bench client · node joins", [4.0, 6.0], 3),
        ("torchrun c10d tuned · bench client · node joins", [8.0, 9.0], 2)]
    assert [r["nodes"] for r in data["rendezvous"]["rendezvous"]["rows"]] == [8, 8, 32, 32, 128, 128]
    assert [pt[0] for pt in sorted(data["checkpoint"]["save"]["safetensors"])] == [0.536870912, 1.073741824]
    # the files differ in their state: the GPT-like one is tagged
    assert data["checkpoint"]["save"]["elasticrun [gpt]"] == [(0.4, 0.4 / 0.5)]
    assert data["checkpoint"]["load"]["safetensors [gpt]"] == [(0.4, 0.4 / 0.5)]
    assert data["checkpoint"]["load"]["disk: cold read [gpt]"] == [(0.4, 2.0)]
    assert not any("async" in name or "verify" in name for op in data["checkpoint"].values() for name in op)


def test_bench_all_presets():
    ba = _load("run_all")
    names = [s.name for s in ba._specs("quick", "/var/tmp")]
    assert {"launch", "elastic", "rendezvous", "snapshot", "preemption"} <= set(names) and len(names) == len(set(names))
    every = {s.script for p in ("quick", "full", "gpu") for s in ba._specs(p, "")}
    assert every == {p.name for p in (SCRIPTS / "bench").glob("bench_*.py")}, "every bench runs in a preset"
    assert ba.main(["--out", "/nonexistent-dir-x", "--only", "nope"]) == 2


@pytest.mark.integration
def test_presets_give_each_bench_only_options_it_takes():
    ba = _load("run_all")
    specs = [s for p in ("quick", "full", "gpu") for s in ba._specs(p, "/var/tmp")]
    for script in sorted({s.script for s in specs}):
        usage = subprocess.run([sys.executable, str(SCRIPTS / "bench" / script), "--help"], capture_output=True,
                               text=True, timeout=240, cwd=str(SCRIPTS.parent)).stdout.split("\n\n")[0]
        taken = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", usage))
        given = {a for s in specs if s.script == script for a in s.args if a.startswith("--")}
        given |= {ba.OUT_OPTION.get(script, "--json")} | ({"--device"} if script in ba.TAKES_DEVICE else set())
        assert given <= taken, f"{script} does not take {sorted(given - taken)}"


def test_without_matplotlib_one_line_error(pr, tmp_path, capsys, monkeypatch):
    d = _results(tmp_path / "res")
    page = tmp_path / "performance.md"
    page.write_text(PAGE)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert pr.main([str(d), "--page", str(page)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "elasticrun[plot]" in err and "--no-plots" in err
    assert page.read_text() == PAGE  # nothing half-written
    assert pr.main([str(d), "--page", str(page), "--no-plots"]) == 0


FAKE_BENCH = '''
import argparse, json, sys, time
ap = argparse.ArgumentParser()
ap.add_argument("--mode")
ap.add_argument("--json", default=None)
a = ap.parse_args()
if a.mode == "sleep":
    time.sleep(60)
if a.mode == "crash":
    raise SystemExit("fake bench: crashed on purpose")
doc = {"summary": [{"metric": "m", "elasticrun": 1.0}]}
if a.json:
    open(a.json, "w").write(json.dumps(doc))
'''


@pytest.mark.integration
def test_bench_all_runs_records_and_goes_on(tmp_path):
    ba = _load("run_all")
    script = tmp_path / "bench_fake.py"
    script.write_text(FAKE_BENCH)
    silent = tmp_path / "bench_silent.py"  # writes no JSON: a failure, whatever its exit code
    silent.write_text("print('warming up')\n")
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.monotonic()
    slow = ba.run_one(ba.Spec("slow", str(script), ["--mode", "sleep"], 60), out, "cpu", sys.executable, limit_s=3)
    assert slow.status is ba.Status.TIMEOUT and time.monotonic() - t0 < 40 and "stopped after 3 s" in slow.notes
    bad = ba.run_one(ba.Spec("bad", str(script), ["--mode", "ok", "--nope", "1"], 60), out, "cpu", sys.executable, 60)
    assert bad.status is ba.Status.FAILED and bad.returncode == 2 and any("--nope" in n for n in bad.notes)
    crash = ba.run_one(ba.Spec("crash", str(script), ["--mode", "crash"], 60), out, "cuda", sys.executable, 60)
    assert crash.status is ba.Status.FAILED and crash.returncode == 1 and crash.json is None
    assert any("crashed on purpose" in n for n in crash.notes) and any("takes no --device" in n for n in crash.notes)
    ok = ba.run_one(ba.Spec("ok", str(script), ["--mode", "ok"], 60), out, "cpu", sys.executable, 60)
    assert ok.status is ba.Status.OK and json.loads((out / "ok.json").read_text())["summary"][0]["metric"] == "m"
    assert "--json" in ok.command and (out / "ok.log").exists()
    (out / "quiet.json").write_text("{}")  # an earlier run's file
    quiet = ba.run_one(ba.Spec("quiet", str(silent), [], 60), out, "cpu", sys.executable, 60)
    assert quiet.status is ba.Status.FAILED and quiet.json is None and "no JSON written" in quiet.notes


def test_bench_all_rerun_updates_the_run_in_place(tmp_path):
    ba = _load("run_all")
    rows = [{"name": n, "script": "bench_x.py", "command": "c", "status": st, "json": f"{n}.json"}
            for n, st in (("a", "ok"), ("b", "failed"), ("gone", "ok"))]
    (tmp_path / "bench_all.json").write_text(json.dumps({"preset": "quick", "device": "cpu", "started": 5.0,
                                                         "host": {"cpus": 2}, "benches": rows}))
    head = {"preset": "quick", "device": "cpu", "started": 9.0, "host": {}}
    kept = ba._earlier(tmp_path, head, rerun={"b"}, preset={"a", "b"})
    assert [(r.name, r.status) for r in kept] == [("a", ba.Status.OK)] and head["started"] == 5.0
    assert ba._earlier(tmp_path, {"preset": "full", "device": "cpu", "started": 1.0, "host": {}}, {"b"}, {"a"}) == []


def test_the_real_page_has_the_markers(pr):
    text = (SCRIPTS.parent / "docs" / "performance.md").read_text()
    assert text.count(pr.BEGIN) == 1 and text.count(pr.END) == 1 and text.index(pr.BEGIN) < text.index(pr.END)
    assert pr.replace_block(text, "x").split(pr.BEGIN)[1].split(pr.END)[0] == "\nx\n"
