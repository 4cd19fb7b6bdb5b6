"""The monitoring files as Prometheus reads them: `promtool check config`,
`check rules` and `test rules` (each alert fires on synthetic series), and
every metric they, the dashboard and the HPAs' adapter rules name is one the
services export."""
from __future__ import annotations

import re
import subprocess

import yaml
from prometheus_client import CollectorRegistry

from helpers.prometheus import DASHBOARD, PROM_DIR, need
from kvpop.runtime.metrics import Metrics

K8S_PROM = PROM_DIR.parent / "k8s" / "prometheus.yml"


def promtool(*args: str) -> str:
    r = subprocess.run([need("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=PROM_DIR)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_promtool_checks_config_and_rules(tmp_path):
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")
    # Debian's Prometheus is built without Kubernetes discovery: check the k8s
    # config with its discovery swapped for a static target (relabelling and
    # all else as shipped), and that it keeps the labels the rest relies on.
    cfg = yaml.safe_load(K8S_PROM.read_text())
    [job] = cfg["scrape_configs"]
    assert job["job_name"] == "kvpop" and job["kubernetes_sd_configs"] == [
        {"role": "pod", "namespaces": {"own_namespace": True}}]
    assert {r.get("target_label") for r in job["relabel_configs"]} >= {"namespace", "pod", "component"}
    job["static_configs"] = [{"targets": ["127.0.0.1:9092"]}]
    del job["kubernetes_sd_configs"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    assert "SUCCESS" in promtool("check", "config", "--syntax-only", str(tmp_path / "prometheus.yml"))
    assert "SUCCESS: 6 rules found" in promtool("check", "rules", "alerts.yml")


def test_promtool_unit_tests_fire_every_alert():
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")
    alerts = {r["alert"] for g in yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((PROM_DIR / "alerts_test.yml").read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a["exp_alerts"]}
    quiet = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if not a["exp_alerts"]}
    assert alerts == fired, alerts ^ fired
    assert alerts == quiet, alerts ^ quiet


def exported_names() -> set[str]:
    names = set()
    for fam in Metrics(CollectorRegistry()).registry.collect():
        names |= {fam.name, *(fam.name + s for s in ("_total", "_bucket", "_count", "_sum"))}
    return names


def test_every_metric_named_is_exported():
    exported = exported_names()
    files = [PROM_DIR / "alerts.yml", PROM_DIR / "adapter.yaml", DASHBOARD]
    named = {n for f in files for n in re.findall(r"\bkvpop_[a-z0-9_]+", f.read_text())}
    # Less the names the adapter gives its own metrics (what the HPAs ask for).
    named -= {r["name"]["as"] for r in yaml.safe_load((PROM_DIR / "adapter.yaml").read_text())["rules"]}
    assert len(named) > 10
    assert named <= exported, named - exported


def test_deploy_doc_lists_every_alert_and_panel():
    import json
    doc = (PROM_DIR.parents[2] / "docs" / "guides" / "deploy.md").read_text()
    alerts = [r["alert"] for g in yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
              for r in g["rules"] if "alert" in r]
    panels = json.loads(DASHBOARD.read_text())["panels"]
    missing = [f"`{a}`" for a in alerts if f"`{a}`" not in doc]
    missing += [t["expr"] for p in panels for t in p["targets"]
                if t["expr"].replace("|", "&#124;") not in doc]
    assert not missing, missing
