"""deploy/grafana/kvturn-dashboard.json queries only metrics the code exports: the router's
(its registry), the connector's (``connector/_stats.py``) and the one of vLLM's it uses."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from prometheus_client.metrics_core import Metric

from kvturn_server.router._metrics import RouterMetrics
from kvturn_server.router._pool import Backend, Pool

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvturn-dashboard.json"
_NAME = re.compile(r"\b(?:kvturn_router_|kvturn:|vllm:)[a-zA-Z0-9_:]*")


def _queried() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    assert len(exprs) > 20
    return {name for e in exprs for name in _NAME.findall(e)}


def _samples(family: Metric) -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                "gauge": ("",)}[family.type]
    return {family.name + s for s in suffixes}


def test_every_router_metric_the_dashboard_queries_exists() -> None:
    pool = Pool("decode", [Backend("decode", "http://d:1")], eject_after=1, readmit_after=1)
    exported = {s for f in RouterMetrics([pool]).registry.collect() for s in _samples(f)}
    queried = {n for n in _queried() if n.startswith("kvturn_router_")}
    assert queried and queried <= exported, sorted(queried - exported)
    # And the dashboard shows every router metric there is.
    families = {f.name for f in RouterMetrics([pool]).registry.collect()}
    shown = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in queried}
    assert families <= shown, sorted(families - shown)


def test_every_connector_and_vllm_metric_the_dashboard_queries_exists() -> None:
    source = (ROOT / "server" / "kvturn_server" / "connector" / "_stats.py").read_text()
    # Counters are declared one by one, gauges in a table of names: every quoted metric name.
    connector = set(re.findall(r'"(kvturn:[a-z_]+)"', source))
    assert len(connector) >= 10
    counters = set(re.findall(r'(\w+) = counter\(\s*name="(kvturn:[a-z_]+)"', source))
    exported = {f"{name}_total" for _, name in counters} | (connector - {n for _, n in counters})
    queried = {n for n in _queried() if n.startswith("kvturn:")}
    assert queried <= exported, sorted(queried - exported)
    assert {n.removesuffix("_total") for n in queried} == connector  # all of them shown
    spec = importlib.util.find_spec("vllm")  # located, not imported (that takes seconds)
    assert spec is not None and spec.origin is not None
    loggers = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    for name in (n for n in _queried() if n.startswith("vllm:")):
        assert f'"{name.removesuffix("_total")}"' in loggers, name
