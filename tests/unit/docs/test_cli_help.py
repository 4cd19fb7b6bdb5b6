"""The `kvpop` command line as a user meets it: one budget flag name (the
older ones still work, with a warning), --help that lists the policies, and
a note when a request does not fit the default task model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpop.cli import build_parser
from kvpop.runtime.paths import REPO_ROOT
from kvpop.runtime.pb import generate_pb2
from kvpop.stack.policy_names import POLICIES
from kvpop.stack.task_model_note import note_for


def test_the_cli_lists_every_policy_compute_serves():
    from services.compute.eviction.policies import POLICY_NAMES

    assert sorted(POLICIES) == sorted(POLICY_NAMES)


@pytest.mark.parametrize("command", ["generate", "up"])
def test_help_lists_the_policies(command):
    r = subprocess.run([sys.executable, "-m", "kvpop.cli", command, "--help"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert ", ".join(POLICIES) in text and "--budget" in text and "--kv-budget" not in text


@pytest.mark.parametrize("argv, value", [
    (["generate", "x", "--budget", "0.5"], "0.5"),
    (["generate", "x", "--kv-budget", "512"], "512"),
    (["bench", "context", "--model", "models/default", "--budget-tokens", "64"], 64),
    (["bench", "engine", "--kv-budget", "0.125"], 0.125),
])
def test_one_budget_flag_and_the_old_names_warn(argv, value, capsys):
    args = build_parser([argv[0]]).parse_args(argv)
    assert args.budget == value
    err = capsys.readouterr().err
    old = next((a for a in argv if a in ("--kv-budget", "--budget-tokens")), None)
    if old:
        assert f"{old} is deprecated; use --budget" in err
    else:
        assert "deprecated" not in err


def _task_prompt() -> str:
    r = subprocess.run([sys.executable, "-m", "kvpop.cli", "tasks", "--family", "registers", "--n", "1",
                        "--length", "500", "--seed", "7", "--json"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=120, check=True)
    return json.loads(r.stdout)["prompt"]


def test_a_note_only_when_the_request_does_not_fit_the_default_model():
    default = generate_pb2.ModelInfo(name="default", chat_template=False)
    assert note_for(default, _task_prompt(), chat=False) is None
    note = note_for(default, "Hello, my name is", chat=False)
    assert "task model" in note and "'Hello,'" in note and "kvpop fetch-model smollm2-135m" in note
    assert "--chat needs one" in note_for(default, None, chat=True)
    smollm2 = generate_pb2.ModelInfo(name="smollm2-135m", chat_template=True)
    assert note_for(smollm2, "Hello, my name is", chat=False) is None
