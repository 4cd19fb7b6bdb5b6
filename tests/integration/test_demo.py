"""scripts/demo.sh uses a stack it finds only when that stack is up and serves
the default model; otherwise it says what to do instead of streaming from it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpop.runtime.paths import REPO_ROOT
from kvpop.stack.state import Proc, Stack


@pytest.mark.slow
def test_demo_refuses_a_stale_stack_and_names_kvpop_down(tmp_path):
    # A stack.json left behind by a stack that is gone: its processes exited.
    gone = subprocess.Popen(["true"])
    gone.wait()
    state = tmp_path / "state"
    state.mkdir()
    Stack(state_dir=str(state), gateway="127.0.0.1:1",
          processes=[Proc(name=n, pid=gone.pid, address="127.0.0.1:1", log="", cmd=[], started="1")
                     for n in ("cache-manager", "compute", "gateway")]).save()
    env = {**os.environ, "KVPOP_STATE_DIR": str(state)}
    r = subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "not all up and SERVING" in r.stderr and "kvpop down" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not r.stdout.strip(), r.stdout


@pytest.mark.slow
def test_demo_does_not_stream_from_a_stack_serving_another_model(tmp_path):
    from helpers.models import save_hf_model
    from kvpop.models.default_model import build_tokenizer

    model = tmp_path / "qwen2"
    save_hf_model(model, "qwen2", seed=1, vocab_size=259, max_position_embeddings=1024)
    build_tokenizer().save(str(model / "tokenizer.json"))
    state = tmp_path / "state"
    env = {**os.environ, "KVPOP_STATE_DIR": str(state)}
    up = subprocess.run([sys.executable, "-m", "kvpop.cli", "up", "--model", str(model), "--timeout", "150"],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    try:
        assert up.returncode == 0, up.stderr
        r = subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "serves qwen2, not the default model" in r.stderr and "kvpop down" in r.stderr, r.stderr
        assert not r.stdout.strip(), r.stdout
    finally:
        subprocess.run([sys.executable, "-m", "kvpop.cli", "down"], cwd=REPO_ROOT, env=env, capture_output=True,
                       timeout=120)
