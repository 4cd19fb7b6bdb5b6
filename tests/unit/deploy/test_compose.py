"""compose/docker-compose.yml without a Docker engine: the file is parsed, every
command of ours is a real entry point that starts, its settings are ones the
services read, and each health check command is run against the services
started locally the way compose starts them (same command, same environment,
host names and ports mapped to loopback)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

from kvpop.stack.up import free_port
from kvpop.runtime.paths import REPO_ROOT as REPO

COMPOSE_DIR = REPO / "compose"
OURS = ("cache-manager", "compute", "gateway")
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def ours(compose) -> list[tuple[str, str, dict]]:
    """(file, service name, service) of every kvpop service in both compose
    files: the main host's and an extra GPU host's (replica.yml)."""
    replica = yaml.safe_load((COMPOSE_DIR / "replica.yml").read_text())
    out = []
    for file, doc in (("docker-compose.yml", compose), ("replica.yml", replica)):
        out += [(file, n, svc) for n, svc in doc["services"].items() if "build" in svc]
    return out


def test_gateway_requires_keys_from_a_compose_secret(compose):
    gw = compose["services"]["gateway"]
    [secret] = gw["secrets"]
    assert _env(gw)["KVPOP_API_KEYS_FILE"] == f"/run/secrets/{secret}"
    assert compose["secrets"][secret]["file"] == "${KVPOP_API_KEYS_HOST_FILE:-./api_keys}"
    assert "/compose/api_keys" in (REPO / ".gitignore").read_text().split()


def test_replica_file_joins_the_shared_redis(compose):
    replica = yaml.safe_load((COMPOSE_DIR / "replica.yml").read_text())
    assert set(replica["services"]) == {"cache-manager", "compute"}
    env = _env(replica["services"]["compute"])
    # Nothing defaults to a host-local guess: compose refuses to start without them.
    for var in ("KVPOP_REDIS_URL", "KVPOP_REPLICA_ID", "KVPOP_ADVERTISE_ADDRESS"):
        assert re.fullmatch(r"\$\{%s:\?[^}]+\}" % var, env[var]), var
    assert env["KVPOP_CACHE_MANAGER_ADDRESS"] == "cache-manager:50053"
    assert replica["services"]["compute"]["deploy"] == compose["services"]["compute"]["deploy"]
    # The main host publishes Redis for them.
    assert any(p.endswith(":6379") for p in compose["services"]["redis"]["ports"])


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _default(value: str) -> str:
    """`${VAR:-default}` as compose resolves it when VAR is unset."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def test_services_and_structure(compose):
    svcs = compose["services"]
    assert set(svcs) == {"redis", "cache-manager", "compute", "gateway", "otel-collector", "jaeger",
                         "prometheus", "grafana"}
    redis = svcs["redis"]
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    # At most the last second of writes lost when Redis is killed (docs/guides/operations.md).
    assert redis["command"][redis["command"].index("--appendfsync") + 1] == "everysec"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "redis-data" in compose["volumes"]

    compute = svcs["compute"]
    [gpu] = compute["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    model_dir = _env(compute)["KVPOP_MODEL_DIR"]
    [mount] = [v for v in compute["volumes"] if v.split(":")[-2] == model_dir]
    assert mount.endswith(":ro")
    # The default mount is the embedded model, which must exist.
    host_dir = (COMPOSE_DIR / _default(mount.rsplit(":", 2)[0])).resolve()
    assert (host_dir / "config.json").is_file()
    # The cache-manager reads the served model's own networks from the same host folder.
    cm = svcs["cache-manager"]
    cm_dir = _default(_env(cm)["KVPOP_ESTIMATOR"])
    [cm_mount] = [v for v in cm["volumes"] if v.split(":")[-2] == cm_dir]
    assert cm_mount.rsplit(":", 2)[0] == mount.rsplit(":", 2)[0] and cm_mount.endswith(":ro")
    assert (host_dir / "estimator.safetensors").is_file()

    for name in OURS:
        build = svcs[name]["build"]
        dockerfile = (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve()
        assert dockerfile == COMPOSE_DIR / "Dockerfile"
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    assert "download.pytorch.org/whl/cu" in dockerfile and '-c constraints.txt -e ".[gpu]"' in dockerfile
    assert re.search(r"^COPY .*\bconstraints\.txt\b", dockerfile, re.M)
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", dockerfile, re.M)
    assert "nvidia/cuda:" in dockerfile

    otel = svcs["otel-collector"]
    cfg_mount = next(v for v in otel["volumes"] if "otel-collector.yaml" in v)
    otel_cfg = yaml.safe_load((COMPOSE_DIR / cfg_mount.split(":")[0]).read_text())
    assert "otlp" in otel_cfg["receivers"]
    assert otel_cfg["exporters"]["otlp/jaeger"]["endpoint"].startswith("jaeger:")
    assert "otlp/jaeger" in otel_cfg["service"]["pipelines"]["traces"]["exporters"]
    for name in OURS:
        assert _env(svcs[name])["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"


def _mount(svc: dict, target: str) -> Path:
    """Host path (resolved from compose/) of the volume mounted at `target`."""
    [host] = [v.split(":")[0] for v in svc["volumes"] if v.split(":")[1] == target]
    return (COMPOSE_DIR / host).resolve()


def test_prometheus_scrapes_every_service_and_grafana_shows_it(compose):
    svcs = compose["services"]
    prom = svcs["prometheus"]
    conf_dir = _mount(prom, "/etc/prometheus")
    config_file = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    cfg = yaml.safe_load((conf_dir / Path(config_file).name).read_text())
    # Every rule file it names is in the mounted folder.
    for f in cfg["rule_files"]:
        assert (conf_dir / f).is_file(), f
    [job] = [j for j in cfg["scrape_configs"] if j["job_name"] == "kvpop"]
    targets = {sc["labels"]["component"]: sc["targets"] for sc in job["static_configs"]}
    # One target per kvpop service: its compose name and its KVPOP_METRICS_PORT.
    assert targets == {n: [f"{n}:{_env(svcs[n])['KVPOP_METRICS_PORT']}"] for n in OURS}
    graf = svcs["grafana"]
    prov = _mount(graf, "/etc/grafana/provisioning")
    [ds] = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["url"] == "http://prometheus:9090" and any(p.endswith(":9090") for p in prom["ports"])
    [provider] = yaml.safe_load((prov / "dashboards" / "kvpop.yml").read_text())["providers"]
    dashboard = _mount(graf, provider["options"]["path"] + "/kvpop.json")
    panels = json.loads(dashboard.read_text())["panels"]
    assert all(t["datasource"]["uid"] == ds["uid"] for p in panels for t in p["targets"])
    assert graf["depends_on"]["prometheus"]["condition"] == "service_healthy"
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in svcs[name]["ports"]), name
        assert svcs[name]["healthcheck"]["test"][0] == "CMD"


def test_services_come_back_and_start_in_health_order(compose, ours):
    """Every service restarts unless stopped; a dependency that a service
    cannot serve without gates its start on health."""
    replica = yaml.safe_load((COMPOSE_DIR / "replica.yml").read_text())
    for doc in (compose, replica):
        for name, svc in doc["services"].items():
            assert svc.get("restart") == "unless-stopped", name
    deps = {n: svc.get("depends_on", {}) for n, svc in compose["services"].items()}
    assert deps["gateway"]["compute"]["condition"] == "service_healthy"
    assert deps["gateway"]["redis"]["condition"] == "service_healthy"
    assert deps["compute"]["redis"]["condition"] == "service_healthy"
    # Compute serves (degraded, said by kvpop.compute.advisor) without the cache-manager.
    assert deps["compute"]["cache-manager"]["condition"] == "service_started"
    # Compute holds every caller to the gateway's limits; a published replica requires the token.
    gw, comp = _env(compose["services"]["gateway"]), _env(compose["services"]["compute"])
    for var in ("KVPOP_MAX_PROMPT_CHARS", "KVPOP_MAX_TOKENS_LIMIT"):
        assert gw[var] == comp[var] == _env(replica["services"]["compute"])[var], var
    assert re.fullmatch(r"\$\{KVPOP_INTERNAL_TOKEN:\?[^}]+\}", _env(replica["services"]["compute"])["KVPOP_INTERNAL_TOKEN"])


def test_health_checks_timing_and_targets(compose, ours):
    assert {n for _, n, _ in ours} == set(OURS)
    for file, name, svc in [("docker-compose.yml", "redis", compose["services"]["redis"]), *ours]:
        hc = svc["healthcheck"]
        assert (hc["interval"], hc["timeout"], hc["retries"]) == ("30s", "5s", 3), (file, name)
        assert hc["test"][0] == "CMD"
    for file, name, svc in ours:
        env = _env(svc)
        grpc_port = next(v for k, v in env.items() if re.fullmatch(r"KVPOP_[A-Z_]+_PORT", k)
                         and k != "KVPOP_METRICS_PORT")
        test = svc["healthcheck"]["test"][1:]
        assert test[:3] == ["python", "-m", "kvpop.runtime.healthcheck"], name
        assert test[test.index("--grpc") + 1] == f"127.0.0.1:{grpc_port}", name
        assert test[test.index("--http") + 1] == \
            f"http://127.0.0.1:{env['KVPOP_METRICS_PORT']}/healthz", name
        # Internal ports follow KVPOP_TLS_* (set in every container); the
        # public gateway port is plaintext whatever they say.
        assert ("--plaintext" in test) == (name == "gateway"), name


def test_commands_are_our_entry_points_and_start(ours, scripts):
    eps = {ep.name: ep for ep in entry_points(group="console_scripts")}
    for file, name, svc in ours:
        [cmd] = svc["command"]
        assert cmd == f"kvpop-{name}" and cmd in scripts, file
        if file != "docker-compose.yml":
            continue    # same entry points: started once below
        target = scripts[cmd]
        assert target == f"services.{name.replace('-', '_')}.__main__:main"
        # Installed (pip install -e) and resolving to a callable.
        assert eps[cmd].value == target
        assert callable(eps[cmd].load())
        r = subprocess.run([str(BIN / cmd), "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "--port" in r.stdout


def _settings(name: str) -> set[str]:
    """Variables a service reads: its config class, the security ones."""
    from kvpop.runtime import config
    from kvpop.runtime import security
    cls = {"gateway": config.GatewayConfig, "compute": config.ComputeConfig,
           "cache-manager": config.CacheManagerConfig}[name]
    return {getattr(security, n) for n in dir(security) if n.startswith("ENV_")} | \
        {f.metadata["env"] for f in dataclasses.fields(cls)}


def test_every_setting_is_read_by_its_service_and_documented(ours):
    doc = (REPO / "docs" / "reference" / "configuration.md").read_text()
    for file, name, svc in ours:
        known = _settings(name)
        for var in _env(svc):
            if var.startswith("OTEL_"):
                continue
            assert var in known, f"{file}: {name}: {var} is not a setting of kvpop-{name}"
        for var in known:
            assert f"`{var}`" in doc, f"{var} missing from docs/reference/configuration.md"


# ---- health check commands against locally started services ----------------

class LocalStack:
    """The compose services as local processes: compose's own commands and
    environment, with service names and container ports mapped to loopback."""

    def __init__(self, compose: dict, redis_port: int, tmp: Path):
        self.compose = compose
        self.tmp = tmp
        self.ports = {"6379": str(redis_port)}
        for name in OURS:
            for k, v in _env(compose["services"][name]).items():
                if re.fullmatch(r"KVPOP_[A-Z_]+_PORT", k):
                    self.ports.setdefault(v, str(free_port()))
        self.procs: dict[str, subprocess.Popen] = {}

    def localise(self, s: str) -> str:
        def sub(m):
            port = self.ports.get(m.group(2))
            return f"127.0.0.1:{port}" if port else m.group(0)
        return re.sub(r"\b(127\.0\.0\.1|[a-z][a-z0-9-]*):(\d+)\b", sub, s)

    def env_for(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOP_", "OTEL_"))}
        for k, v in _env(self.compose["services"][name]).items():
            v = _default(v)
            env[k] = self.ports[v] if re.fullmatch(r"KVPOP_[A-Z_]+_PORT", k) else self.localise(v)
        env.update(KVPOP_HOST="127.0.0.1", OTEL_TRACES_EXPORTER="none", KVPOP_LOG_LEVEL="WARNING")
        if name == "compute":
            # What the default volume mounts; no GPU here.
            env.update(KVPOP_MODEL_DIR=str(REPO / "models" / "default"), KVPOP_DEVICE="cpu",
                       KVPOP_MAX_NUM_SEQS="4", KVPOP_MAX_MODEL_LEN="512")
        if name == "cache-manager":
            env.update(KVPOP_ESTIMATOR=str(REPO / "models" / "default"))
        if name == "gateway":
            # The compose secret, as `kvpop keys new` makes it on the host.
            from services.gateway.apikeys import append_key, new_key
            keys = self.tmp / "api_keys"
            if not keys.exists():
                append_key(keys, "compose-test", new_key())
            env.update(KVPOP_API_KEYS_FILE=str(keys))
        return {k: v for k, v in env.items() if v != "" or not k.startswith("KVPOP_")}

    def start(self, name: str) -> None:
        [cmd] = self.compose["services"][name]["command"]
        log = open(self.tmp / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([str(BIN / cmd)], env=self.env_for(name), cwd=self.tmp,
                                            stdout=log, stderr=subprocess.STDOUT)

    def health_cmd(self, name: str) -> list[str]:
        test = self.compose["services"][name]["healthcheck"]["test"][1:]
        exe = {"python": sys.executable, "redis-cli": shutil.which("redis-cli")}
        return [exe.get(test[0], test[0])] + [self.localise(a) for a in test[1:]]

    def check(self, name: str) -> subprocess.CompletedProcess:
        timeout = float(self.compose["services"][name]["healthcheck"]["timeout"].rstrip("s"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOP_")}
        # compose kills a probe at its timeout; allow process start-up on top.
        return subprocess.run(self.health_cmd(name), capture_output=True, text=True,
                              timeout=timeout + 20, env=env)

    def wait_healthy(self, name: str, deadline_s: float) -> subprocess.CompletedProcess:
        deadline = time.monotonic() + deadline_s
        while True:
            r = self.check(name)
            if r.returncode == 0:
                return r
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode}:\n" + self.log(name))
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} not healthy in {deadline_s}s: {r.stdout}{r.stderr}\n"
                                     + self.log(name))
            time.sleep(0.5)

    def log(self, name: str) -> str:
        p = self.tmp / f"{name}.log"
        return p.read_text()[-3000:] if p.exists() else ""

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)


@pytest.mark.slow
def test_health_check_commands_against_local_services(compose, redis_server, tmp_path):
    stack = LocalStack(compose, redis_server.port, tmp_path)
    try:
        assert stack.check("redis").returncode == 0
        # Before anything listens, every probe fails (and fails within its timeout).
        for name in OURS:
            t0 = time.monotonic()
            r = stack.check(name)
            assert r.returncode == 1 and "UNAVAILABLE" in r.stdout, (name, r.stdout, r.stderr)
            assert time.monotonic() - t0 < 25
        for name in OURS:   # compose's dependency order
            stack.start(name)
        for name in OURS:
            r = stack.wait_healthy(name, deadline_s=120)
            assert "SERVING" in r.stdout and "200" in r.stdout, r.stdout
        # Compute joined the replica registry under compose's id and advertised address.
        import json

        import redis
        rc = redis.Redis(port=redis_server.port, decode_responses=True)
        entry = json.loads(rc.get("kvpop:v1:replica:compute-0"))
        assert entry["address"] == stack.localise(_env(compose["services"]["compute"])["KVPOP_ADVERTISE_ADDRESS"])
        # A stopped service turns its probe red.
        stack.stop("cache-manager")
        assert stack.check("cache-manager").returncode == 1
    finally:
        stack.close()
