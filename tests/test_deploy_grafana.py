"""deploy/grafana/elasticrun.json: well-formed, and every panel's PromQL names only metrics the agent exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from elasticrun.launch.goodput import Goodput
from elasticrun.launch.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "elasticrun.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _exported() -> set:
    """Every sample name the agent's registry renders (histograms observed once so their series exist)."""
    g = Goodput()
    state = {**g.summary(), "counters": g.counters(), "round": 1, "world_size": 2, "nodes": 1, "step": 5,
             "samples_per_s": 3.0, "role": "leader", "lease": "held", "rescales": {"ScaleUp": 1}}
    m = Metrics("j", "n", lambda: state)
    m.observe_etcd("get", 0.01)
    m.checkpoint.observe(0.1)
    m.snapshot.observe(0.1)
    text = m.app.render("")[1].decode()
    return {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            for line in text.splitlines() if line and not line.startswith("#")}


def _exprs(dash: dict) -> list:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_every_panel_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exported = _exported()
    used = set()
    for title, expr in _exprs(dash):
        names = set(re.findall(r"\belasticrun_[a-z_]+", expr))
        assert names, f"{title}: no elasticrun metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{title}: {sorted(unknown)} are not exported"
        used |= names
    for var in dash["templating"]["list"][1:]:
        assert set(re.findall(r"\belasticrun_[a-z_]+", var["definition"])) <= exported
    # the list: world size, rounds, step rate, goodput, badput by cause, restarts, rescales,
    # checkpoint stalls, etcd latency, lease state
    for name in ("elasticrun_world_size", "elasticrun_round", "elasticrun_step", "elasticrun_phase_seconds_total",
                 "elasticrun_training_lost_seconds_total",
                 "elasticrun_badput_seconds_total", "elasticrun_restarts_total", "elasticrun_rescales_total",
                 "elasticrun_checkpoint_seconds_bucket", "elasticrun_etcd_request_seconds_bucket",
                 "elasticrun_lease_state"):
        assert name in used, name


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "node"} <= set(variables)
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert '$job' in t["expr"] and '$node' in t["expr"], (p["title"], t["expr"])
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
    cells = [(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in dash["panels"]
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])]
    assert len(cells) == len(set(cells)), "panels overlap"
