"""KVPOP_* settings: flag over env over default; bad values fail with the culprit's name."""
from __future__ import annotations

import argparse

import pytest

from kvpop.runtime.config import (CacheManagerConfig, ComputeConfig, ConfigError, GatewayConfig, add_arguments,
                          describe, load)


def parse(cls, argv):
    p = argparse.ArgumentParser()
    add_arguments(p, cls)
    return p.parse_args(argv)


def test_defaults_bind_loopback():
    for cls in (GatewayConfig, ComputeConfig, CacheManagerConfig):
        assert load(cls, env={}).host == "127.0.0.1"


def test_flag_beats_env_beats_default():
    env = {"KVPOP_GATEWAY_PORT": "6000", "KVPOP_MAX_PROMPT_CHARS": "100"}
    cfg = load(GatewayConfig, parse(GatewayConfig, ["--port", "7000"]), env=env)
    assert cfg.port == 7000 and cfg.max_prompt_chars == 100 and cfg.default_max_tokens == 128


def test_optional_ints_and_bools():
    cfg = load(ComputeConfig, env={"KVPOP_NUM_PAGES": "", "KVPOP_MAX_MODEL_LEN": "512"})
    assert cfg.num_pages is None and cfg.max_model_len == 512


@pytest.mark.parametrize("env, culprit", [
    ({"KVPOP_GATEWAY_PORT": "http"}, "KVPOP_GATEWAY_PORT"),
    ({"KVPOP_GRACE_S": "-1"}, "KVPOP_GRACE_S"),
    ({"KVPOP_DEFAULT_BUDGET": "1.5"}, "KVPOP_DEFAULT_BUDGET"),
    ({"KVPOP_DEFAULT_BUDGET": "lots"}, "KVPOP_DEFAULT_BUDGET"),
    ({"KVPOP_DEFAULT_MAX_TOKENS": "99999"}, "KVPOP_DEFAULT_MAX_TOKENS"),
])
def test_bad_values_name_the_variable(env, culprit):
    with pytest.raises(ConfigError, match=culprit):
        load(GatewayConfig, env=env)


def test_prefill_chunk_must_be_positive():
    assert load(ComputeConfig, env={"KVPOP_PREFILL_CHUNK": "128"}).prefill_chunk == 128
    with pytest.raises(ConfigError, match="KVPOP_PREFILL_CHUNK"):
        load(ComputeConfig, env={"KVPOP_PREFILL_CHUNK": "0"})


def test_budget_parsing():
    assert load(GatewayConfig, env={"KVPOP_DEFAULT_BUDGET": "512"}).budget() == 512
    assert load(GatewayConfig, env={"KVPOP_DEFAULT_BUDGET": "0.25"}).budget() == 0.25
    assert load(GatewayConfig, env={"KVPOP_DEFAULT_BUDGET": ""}).budget() is None


def test_every_setting_is_documented():
    table = describe()
    for cls in (GatewayConfig, ComputeConfig, CacheManagerConfig):
        for name in cls.__dataclass_fields__:
            env = cls.__dataclass_fields__[name].metadata["env"]
            assert f"`{env}`" in table


def test_service_rejects_bad_config_cleanly(capsys):
    from services.cache_manager.__main__ import main

    assert main(["--port", "notaport"]) == 2
    err = capsys.readouterr().err
    assert "--port='notaport'" in err and "Traceback" not in err


def test_cleanup_threshold_takes_a_share_or_inf():
    assert load(ComputeConfig, env={}).cleanup_threshold == 0.7
    assert load(ComputeConfig, env={"KVPOP_CLEANUP_THRESHOLD": "inf"}).cleanup_threshold == float("inf")
    for bad in ("0", "-1", "nan", "most"):
        with pytest.raises(ConfigError, match="KVPOP_CLEANUP_THRESHOLD"):
            load(ComputeConfig, env={"KVPOP_CLEANUP_THRESHOLD": bad})
