"""Scrape agents' ``/metrics`` every ``--every`` seconds into a JSON-lines file (what Prometheus would store).

    python scripts/perf/scrape_metrics.py 127.0.0.1:9400 127.0.0.1:9401 -o scrapes.jsonl --every 0.5

One line per successful scrape: ``{"time", "target", "samples": [[name, {labels}, value], ...]}``.
A target that does not answer (not up yet, gone) is skipped that turn. Stops on Ctrl-C, after
``--duration`` seconds, or once every target that answered has stopped answering for ``--idle`` s.
``scripts/perf/plot_dashboard.py`` draws deploy/grafana/elasticrun.json's panels from the file.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from typing import Any, List, Optional

from prometheus_client.parser import text_string_to_metric_families


def scrape(target: str, timeout: float = 2.0) -> List[List[Any]]:
    """The samples of one scrape of ``http://target/metrics``: [name, labels, value] each."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    return [[s.name, dict(s.labels), s.value] for f in text_string_to_metric_families(text) for s in f.samples]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("targets", nargs="+", help="HOST:PORT of each agent's --metrics-port")
    p.add_argument("-o", "--out", required=True, help="JSON-lines file to append to")
    p.add_argument("--every", type=float, default=0.5, help="seconds between scrapes")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    p.add_argument("--idle", type=float, default=10.0, help="stop once every target is silent this long")
    args = p.parse_args(argv)
    start = time.monotonic()
    last_ok = {t: 0.0 for t in args.targets}
    with open(args.out, "a", encoding="utf-8") as out:
        try:
            while not args.duration or time.monotonic() - start < args.duration:
                turn = time.monotonic()
                for target in args.targets:
                    try:
                        samples = scrape(target)
                    except OSError:
                        continue
                    last_ok[target] = turn
                    out.write(json.dumps({"time": round(time.time(), 3), "target": target, "samples": samples}) + "\n")
                out.flush()
                seen = [t for t in last_ok.values() if t]
                if seen and turn - max(seen) > args.idle:
                    break
                time.sleep(max(0.0, args.every - (time.monotonic() - turn)))
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
