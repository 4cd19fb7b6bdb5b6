"""API key lists, per-key windows, and the refusal to serve a network address
without keys (`kvpop up` and the gateway itself, as real processes)."""
from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from kvpop.runtime.config import ConfigError, GatewayConfig, is_loopback, load
from kvpop.runtime.paths import REPO_ROOT
from services.gateway.apikeys import KeyFileError, KeyRing, append_key, hash_key, new_key, parse, remove_key
from services.gateway.rates import KeyRates, RateExceeded


def test_key_lines_parse_and_bad_ones_name_their_entry():
    key = new_key()
    [k] = parse(f"# comment\n\nalice {hash_key(key)} streams=2 max_tokens=64  # why\n", "f")
    assert k.name == "alice" and k.limits == {"streams": 2, "max_tokens": 64}
    assert [x.name for x in parse(f"a {hash_key('x')}; b {hash_key('y')}", "env")] == ["a", "b"]
    for text, words in ((f"a {hash_key('x')}\na {hash_key('y')}", "twice"),
                        (f"a {key}", "never the key"),
                        (f"a b {hash_key('x')}", "sha256"),
                        (f"a/b {hash_key('x')}", "key name"),
                        (f"a {hash_key('x')} speed=3", "streams=N"),
                        ("alone", "expected")):
        with pytest.raises(KeyFileError) as e:
            parse(text, "keys.txt")
        assert words in str(e.value) and "keys.txt: entry" in str(e.value), text


def test_ring_identifies_reloads_in_place_and_keeps_old_keys_on_a_broken_file(tmp_path):
    path = tmp_path / "keys"
    a, b = new_key(), new_key()
    append_key(path, "a", a)
    ring = KeyRing(str(path))
    assert ring.identify(a).name == "a" and ring.identify(b) is None and ring.identify("") is None
    inode = path.stat().st_ino
    append_key(path, "b", b)
    assert ring.identify(b).name == "b"
    assert remove_key(path, "a") and ring.identify(a) is None
    assert path.stat().st_ino == inode, "rewritten in place (a bind mount keeps seeing it)"
    with pytest.raises(KeyFileError):
        append_key(path, "b", new_key())
    path.write_text("garbage line\n")
    assert ring.identify(b).name == "b", "a broken file keeps the previous keys"
    (tmp_path / "empty").write_text("# none\n")
    with pytest.raises(KeyFileError, match="no keys"):
        KeyRing(str(tmp_path / "empty"))
    with pytest.raises(KeyFileError, match="kvpop keys new"):
        KeyRing(str(tmp_path / "missing"))


def test_windows_refuse_with_when_to_retry():
    now = [1000.0]
    rates = KeyRates(clock=lambda: now[0])
    for _ in range(3):
        rates.admit("k", 3, 0)
        now[0] += 10
    with pytest.raises(RateExceeded) as e:
        rates.admit("k", 3, 0)
    # The oldest of the three leaves the window 60 s after it came: 30 s from now.
    assert e.value.retry_after_s == 30 and "retry in 30 s" in e.value.message
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.limit == "requests_per_minute"
    now[0] += 30
    rates.admit("k", 3, 0)
    rates.admit("other", 3, 0)      # per key
    rates.generated("t", 8)
    now[0] += 5
    rates.generated("t", 8)
    with pytest.raises(RateExceeded) as e:
        rates.admit("t", 0, 10)
    assert e.value.limit == "tokens_per_minute" and e.value.retry_after_s == 55
    now[0] += 55
    rates.admit("t", 0, 10)


def test_loopback_addresses():
    assert all(map(is_loopback, ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.5", "example.com")))


def test_gateway_config_refuses_a_network_address_without_keys():
    with pytest.raises(ConfigError, match="KVPOP_ALLOW_NO_KEYS"):
        load(GatewayConfig, env={"KVPOP_HOST": "0.0.0.0"})
    load(GatewayConfig, env={"KVPOP_HOST": "0.0.0.0", "KVPOP_ALLOW_NO_KEYS": "true"})
    load(GatewayConfig, env={"KVPOP_HOST": "0.0.0.0", "KVPOP_API_KEYS": f"a {hash_key('x')}"})
    load(GatewayConfig, env={})


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOP_")}
    return {**env, "PYTHONPATH": str(REPO_ROOT)}


def test_kvpop_up_on_a_network_address_without_keys_refuses_and_says_how_to_opt_out(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvpop.cli", "up", "--host", "0.0.0.0", "--state-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO_ROOT)
    assert r.returncode == 1, r.stderr
    assert "without API keys" in r.stderr and "--allow-no-keys" in r.stderr and "--api-keys-file" in r.stderr
    assert not (tmp_path / "stack.json").exists(), "nothing was started"
    # The gateway alone refuses too (compose, Kubernetes), before binding anything.
    r = subprocess.run([sys.executable, "-m", "services.gateway", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO_ROOT)
    assert r.returncode == 2 and "KVPOP_ALLOW_NO_KEYS" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_kvpop_keys_cli_makes_lists_and_revokes(tmp_path):
    path = tmp_path / "keys"
    cli = [sys.executable, "-m", "kvpop.cli", "keys"]
    r = subprocess.run([*cli, "new", "alice", "--file", str(path), "--streams", "2"], capture_output=True,
                       text=True, timeout=60, env=_env(), cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    assert key not in path.read_text() and hash_key(key) in path.read_text()
    r = subprocess.run([*cli, "list", "--file", str(path)], capture_output=True, text=True, timeout=60, env=_env(),
                       cwd=REPO_ROOT)
    assert r.stdout.split() == ["alice", "streams=2"]
    r = subprocess.run([*cli, "hash"], input=key + "\n", capture_output=True, text=True, timeout=60, env=_env(),
                       cwd=REPO_ROOT)
    assert r.stdout.strip() == hash_key(key)
    r = subprocess.run([*cli, "revoke", "alice", "--file", str(path)], capture_output=True, text=True, timeout=60,
                       env=_env(), cwd=REPO_ROOT)
    assert r.returncode == 0 and parse(path.read_text(), "f") == []
