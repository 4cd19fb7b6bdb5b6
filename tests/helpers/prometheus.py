"""A real Prometheus (Debian's `prometheus`, installed by scripts/setup.sh) as a
child process on a free port, configured from the shipped compose config with
its targets pointed at a running stack, and the queries the deployment makes:
the Grafana dashboard's and the Prometheus Adapter's (the HPAs' custom metrics)."""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from helpers.common import REPO, free_port, stop_processes

PROM_DIR = REPO / "deploy" / "monitoring" / "prometheus"
DASHBOARD = REPO / "deploy" / "monitoring" / "grafana" / "kvpop.json"
K8S_BASE = REPO / "deploy" / "k8s" / "base"


def need(tool: str) -> str:
    import pytest
    exe = shutil.which(tool)
    if exe is None:
        pytest.skip(f"{tool} not found: scripts/setup.sh installs Debian's prometheus package "
                    "(it could not be installed on this machine)")
    return exe


def stack_config(targets: dict[str, str], interval: str = "1s") -> dict:
    """deploy/monitoring/prometheus/prometheus.yml with each kvpop component's target
    replaced by `targets[component]` (host:port) and a short scrape interval."""
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval=interval, evaluation_interval=interval)
    cfg["rule_files"] = [str(PROM_DIR / f) for f in cfg["rule_files"]]
    [job] = [j for j in cfg["scrape_configs"] if j["job_name"] == "kvpop"]
    for sc in job["static_configs"]:
        sc["targets"] = [targets[sc["labels"]["component"]]]
    cfg["scrape_configs"] = [job]
    return cfg


class Prometheus:
    def __init__(self, config: dict):
        self.dir = Path(tempfile.mkdtemp(prefix="kvpop-prometheus-"))
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> "Prometheus":
        log = open(self.dir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [need("prometheus"), f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return (self.dir / "prometheus.log").read_text()[-3000:]

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        stop_processes([self.proc], timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def dashboard_queries() -> dict[str, str]:
    """'panel title / legend' -> PromQL, for every target of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return {f"{p['title']} / {t['legendFormat']}": t["expr"] for p in dash["panels"] for t in p["targets"]}


def hpa_queries(label_matchers: dict[str, str]) -> dict[str, str]:
    """The custom metric of each HPA in the k8s base, as the Prometheus Adapter
    queries it: its rule's metricsQuery with the templates filled in.
    label_matchers: HPA target name -> what `<<.LabelMatchers>>` becomes
    (in a cluster: the namespace and pods the HPA scales)."""
    rules = {r["name"]["as"]: r for r in yaml.safe_load((PROM_DIR / "adapter.yaml").read_text())["rules"]}
    out = {}
    for path in sorted(K8S_BASE.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "HorizontalPodAutoscaler":
                continue
            target = doc["spec"]["scaleTargetRef"]["name"]
            for metric in doc["spec"]["metrics"]:
                if metric["type"] != "Pods":
                    continue
                name = metric["pods"]["metric"]["name"]
                rule = rules[name]
                series = rule["seriesQuery"].split("{", 1)[0]
                q = (rule["metricsQuery"].replace("<<.Series>>", series)
                     .replace("<<.LabelMatchers>>", label_matchers[target])
                     .replace("<<.GroupBy>>", "instance"))
                out[f"{target} HPA: {name}"] = q
    return out
