"""`kvpop up`, `kvpop generate`, `kvpop status`, `kvpop restart`, `kvpop down`
end to end, as a user runs them, serving a checkpoint given by --model (a tiny
random Qwen2 in HF layout)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from helpers.models import save_hf_model
from kvpop.stack.up import Proc
from kvpop.models.default_model import build_tokenizer
from kvpop.runtime.paths import REPO_ROOT
from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc


def kvpop(*args, state_dir, timeout=180):
    env = {**os.environ, "KVPOP_STATE_DIR": str(state_dir)}
    return subprocess.run([sys.executable, "-m", "kvpop.cli", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_up_generate_down(tmp_path):
    model = tmp_path / "qwen2"
    save_hf_model(model, "qwen2", seed=1, vocab_size=259, max_position_embeddings=1024)
    build_tokenizer().save(str(model / "tokenizer.json"))   # byte-level, 259 ids
    state = tmp_path / "state"
    missing = kvpop("up", "--model", str(model), "--estimator", str(tmp_path / "nope.safetensors"), state_dir=state,
                    timeout=60)
    assert missing.returncode == 2 and "nope.safetensors: no such file, and not a shipped estimator" in missing.stderr
    assert "smollm2-135m-long" in missing.stderr      # the shipped names are listed
    assert not (state / "stack.json").exists()
    # A network chosen apart from the model folder (the default model's: another shape, so this
    # model's sequences are still ranked by the heuristic, below).
    net = tmp_path / "chosen" / "estimator.safetensors"
    net.parent.mkdir()
    net.write_bytes((REPO_ROOT / "models/default/estimator.safetensors").read_bytes())
    up = kvpop("up", "--model", str(model), "--block-size", "8", "--timeout", "150", "--estimator", str(net),
               state_dir=state)
    assert up.returncode == 0, up.stderr
    streaming = None
    try:
        stack = json.loads((state / "stack.json").read_text())
        assert up.stdout.strip() == stack["gateway"]
        assert {p["name"] for p in stack["processes"]} == {"redis", "cache-manager", "compute", "gateway",
                                                            "supervisor"}
        assert "gateway        SERVING" in up.stderr
        # Every address labelled: the gateway's, and each service's metrics URL by name.
        assert f"gateway (gRPC, kvpop.v1.KVpop): {stack['gateway']}" in up.stderr
        for name, url in stack["metrics"].items():
            assert f"{name} {url}" in up.stderr
        # Closed by default: a fresh internal token only this user can read.
        token = state / "internal_token"
        assert stack["token_file"] == str(token) and (token.stat().st_mode & 0o777) == 0o600
        assert f"internal token (compute, cache-manager) in {token}" in up.stderr
        status = kvpop("status", state_dir=state, timeout=60)
        assert status.returncode == 0 and "all up and SERVING" in status.stdout, status.stdout + status.stderr
        assert "advisor SERVING" in status.stdout, status.stdout
        with grpc.insecure_channel(stack["gateway"]) as ch:
            info = generate_pb2_grpc.KVpopStub(ch).GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
        assert info.architecture == "qwen2" and info.max_model_len == 1024 and not info.placeholder

        # A second `up` on the same state refuses instead of starting twins.
        again = kvpop("up", state_dir=state, timeout=30)
        assert again.returncode == 1 and "already running" in again.stderr

        # Long enough for a budget of 0.25 to evict: the usage line says who ranked the blocks
        # (the cache-manager's heuristic: no estimator fits this model).
        story = "Once upon a time " * 20
        gen = kvpop("generate", story, "--max-tokens", "16", "--ignore-eos", "--policy", "learned",
                    "--budget", "0.25", "--seed", "3", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50",
                    "--stop", "zzzz", "--session", "cli-test", state_dir=state, timeout=60)
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.strip(), "no text streamed"
        assert "[length]" in gen.stderr and "completion 16 tok" in gen.stderr and "policy learned" in gen.stderr
        assert "(network 0.0%; cache-manager heuristic" in gen.stderr and "fallback" not in gen.stderr, gen.stderr
        assert f"estimator loaded from {net}" in (state / "logs" / "cache-manager.log").read_text()
        # Same seed, same text: served learned evictions do not depend on timing.
        same = [kvpop("generate", story, "--max-tokens", "16", "--ignore-eos", "--policy", "learned",
                      "--budget", "0.25", "--seed", "3", "--temperature", "0.8", "--top-p", "0.9",
                      "--top-k", "50", state_dir=state, timeout=60) for _ in range(2)]
        assert same[0].returncode == 0 and same[0].stdout.strip() and same[0].stdout == same[1].stdout

        # One service restarted on request: a new pid, SERVING, the stack still answers.
        old_pid = next(p["pid"] for p in stack["processes"] if p["name"] == "cache-manager")
        restart = kvpop("restart", "cache-manager", state_dir=state, timeout=120)
        assert restart.returncode == 0 and f"pid {old_pid} ->" in restart.stderr, restart.stderr
        now = json.loads((state / "stack.json").read_text())
        assert next(p["pid"] for p in now["processes"] if p["name"] == "cache-manager") != old_pid
        status = json.loads(kvpop("status", "--json", state_dir=state, timeout=60).stdout)
        cm = next(p for p in status["processes"] if p["name"] == "cache-manager")
        assert cm["restarts"] == 1 and not cm["crash_loop"] and cm["health"][""] == "SERVING", cm
        assert kvpop("restart", "nope", state_dir=state, timeout=30).returncode == 2

        bad = kvpop("generate", "x", "--policy", "nope", state_dir=state, timeout=60)
        assert bad.returncode == 1
        assert "INVALID_ARGUMENT: unknown policy 'nope'" in bad.stderr and "Traceback" not in bad.stderr

        # `kvpop down` while a stream runs: the gateway drains it before compute goes away.
        env = {**os.environ, "KVPOP_STATE_DIR": str(state)}
        streaming = subprocess.Popen([sys.executable, "-m", "kvpop.cli", "generate", "Drain me", "--max-tokens",
                                      "200", "--ignore-eos", "--policy", "dense"], cwd=REPO_ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert os.read(streaming.stdout.fileno(), 1), "the stream never started"
    finally:
        down = kvpop("down", state_dir=state, timeout=90)
    assert down.returncode == 0, down.stderr
    assert streaming is not None
    _, err = streaming.communicate(timeout=30)
    assert streaming.returncode == 0 and b"completion 200 tok" in err, err.decode(errors="replace")
    assert not (state / "stack.json").exists() and not (state / "internal_token").exists()
    assert not any(Proc(**p).alive() for p in stack["processes"] + now["processes"]), \
        "a process survived `kvpop down`"
    nostack = kvpop("generate", "x", state_dir=state, timeout=60)
    assert nostack.returncode != 0 and "kvpop up" in nostack.stderr and "Traceback" not in nostack.stderr
