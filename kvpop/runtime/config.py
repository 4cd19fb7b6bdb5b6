"""Service configuration: every knob is a `KVPOP_*` environment variable and a
command-line flag (the flag wins; unset means the default below).

`python -m kvpop.runtime.config` prints the table of all settings. Bad values fail at
start with a message naming the variable, never deep inside a request.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from kvpop.runtime import prefill_protocol
from kvpop.runtime.paths import DEFAULT_MODEL_DIR
# The largest prefill_allowance a request may ask (a multiple of its budget held
# during prefill; gateway and compute check it): beyond it, evict_after_prompt says it plainly.
from kvpop.runtime.prefill_protocol import MAX_PREFILL_ALLOWANCE  # noqa: F401 - read from here by gateway and compute

# Tokens between a decoding `learned` sequence's eviction plans (compute's
# KVPOP_PLAN_INTERVAL, the engine's and the trace recorder's default).
PLAN_INTERVAL = 8
# Prompt tokens prefilled per engine step (compute's KVPOP_PREFILL_CHUNK, the
# engine's, the eval's and the trace recorder's default): a budget held during
# prefill holds after each chunk.
PREFILL_CHUNK = 512
# When a request's budget starts to hold if it sets neither evict_after_prompt nor
# prefill_allowance (kvpop/runtime/prefill_protocol.py): the gateway's KVPOP_DEFAULT_PREFILL
# and the eval's and benchmarks' policy labels without a protocol suffix. "after":
# on text no network was trained on, a budget held during prefill loses the facts a
# question at the prompt's end asks for; after the prompt, learned at 87.5% answers
# as dense does, at the price of a prefill peak of the whole prompt
# (docs/results/long-context.md#held-out-text-and-the-default-prefill-protocol).
DEFAULT_PREFILL = "after"

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting could not be parsed or is out of range."""


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false, got {s!r}")


def _optional_int(s: str) -> int | None:
    return None if s.strip() in ("", "none", "auto") else int(s)


def _on_off_auto(s: str) -> str:
    v = s.strip().lower()
    if v == "auto":
        return v
    try:
        return "on" if _parse_bool(v) else "off"
    except ValueError:
        raise ValueError(f"expected on, off or auto, got {s!r}") from None


def _model_folder(s: str) -> str:
    from kvpop.runtime.model_cache import resolve_model
    return resolve_model(s)


def setting(env: str, default: Any, help: str, parse: Callable[[str], Any] | None = None) -> Any:
    if parse is None:
        parse = _parse_bool if isinstance(default, bool) else type(default)
    return field(default=default, metadata={"env": env, "help": help, "parse": parse})


@dataclass
class ServerConfig:
    """Settings every gRPC service shares."""

    host: str = setting("KVPOP_HOST", "127.0.0.1", "address to bind (0.0.0.0 to expose)")
    log_level: str = setting("KVPOP_LOG_LEVEL", "INFO", "python logging level")
    grace_s: float = setting("KVPOP_GRACE_S", 5.0, "on SIGTERM, seconds in-flight streams get to finish")
    max_message_bytes: int = setting("KVPOP_MAX_MESSAGE_BYTES", 4 * 1024 * 1024,
                                     "largest gRPC message accepted (RESOURCE_EXHAUSTED beyond)")
    reflection: str = setting("KVPOP_REFLECTION", "auto", "serve gRPC server reflection: on, off, or auto "
                              "(= on for the public gateway, off for compute and the cache-manager)",
                              _on_off_auto)
    metrics_host: str = setting("KVPOP_METRICS_HOST", "", "address the /metrics HTTP server binds "
                                "('' = KVPOP_HOST; 127.0.0.1 keeps it on loopback while gRPC is exposed)")
    metrics_token: str = setting("KVPOP_METRICS_TOKEN", "", "when set, /metrics answers 401 unless the "
                                 "request has 'Authorization: Bearer <token>' (/healthz and /livez stay open)")

    def validate(self) -> None:
        if not -1 <= getattr(self, "metrics_port", -1) < 65536:
            raise ConfigError("KVPOP_METRICS_PORT must be -1 (off), 0 (any free port) or a port")
        if self.grace_s < 0:
            raise ConfigError("KVPOP_GRACE_S must be >= 0")
        if self.max_message_bytes < 1024:
            raise ConfigError("KVPOP_MAX_MESSAGE_BYTES must be >= 1024")
        if self.reflection not in ("on", "off", "auto"):
            raise ConfigError("KVPOP_REFLECTION must be on, off or auto")
        if not 0 <= getattr(self, "port", 0) < 65536:
            raise ConfigError("port must be in [0, 65535]")


@dataclass
class CacheManagerConfig(ServerConfig):
    port: int = setting("KVPOP_CACHE_MANAGER_PORT", 50053, "cache-manager port (0 = any free port)")
    metrics_port: int = setting("KVPOP_METRICS_PORT", 9093, "HTTP port of /metrics and /healthz "
                                "(0 = any free port, -1 = off)")
    max_plan_blocks: int = setting("KVPOP_MAX_PLAN_BLOCKS", 8192,
                                   "most block numbers per (layer, kv-head) in one eviction plan (8192: a whole 8k prompt at "
                                   "block size 1, which an evict-after-prompt round may need)")
    estimator: str = setting("KVPOP_ESTIMATOR", "", "value-estimation checkpoint(s): a file, a model folder "
                             "(its estimator.safetensors and estimator-*.safetensors) or a comma-separated list, "
                             "each sequence ranked by the one made for its block size and trained for its prompt's "
                             "length ('' = models/default, 'none' = heuristic); SIGHUP reloads them")
    scoring_threads: int = setting("KVPOP_SCORING_THREADS", 1,
                                   "torch threads of the network (small ops: more threads mostly contend "
                                   "with compute for the same cores)")


@dataclass
class ComputeConfig(ServerConfig):
    port: int = setting("KVPOP_COMPUTE_PORT", 50052, "compute port (0 = any free port)")
    metrics_port: int = setting("KVPOP_METRICS_PORT", 9092, "HTTP port of /metrics and /healthz "
                                "(0 = any free port, -1 = off)")
    model: str = setting("KVPOP_MODEL_DIR", str(DEFAULT_MODEL_DIR),
                         "model folder (Hugging Face layout), or a name fetched by `kvpop fetch-model`",
                         _model_folder)
    device: str = setting("KVPOP_DEVICE", "auto", "cpu, cuda, cuda:N or auto")
    dtype: str = setting("KVPOP_DTYPE", "auto", "float32, bfloat16, float16 or auto (the checkpoint's)")
    block_size: int = setting("KVPOP_BLOCK_SIZE", 1, "positions per block: the unit of eviction (1 = token level)")
    page_size: int = setting("KVPOP_PAGE_SIZE", 16, "positions per KV page: the unit of memory "
                             "(a multiple of the block size; rounded down to one)")
    num_pages: int | None = setting("KVPOP_NUM_PAGES", None, "KV pool pages (default: sized by the engine)",
                                    _optional_int)
    max_num_seqs: int = setting("KVPOP_MAX_NUM_SEQS", 64, "most sequences decoding at once")
    max_model_len: int | None = setting("KVPOP_MAX_MODEL_LEN", None,
                                        "longest sequence (default: the model's)", _optional_int)
    cache_manager_address: str = setting("KVPOP_CACHE_MANAGER_ADDRESS", "",
                                         "host:port of the cache-manager ('' = none: local fallback only)")
    replica_id: str = setting("KVPOP_REPLICA_ID", "", "name of this compute replica ('' = host:port)")
    redis_url: str = setting("KVPOP_REDIS_URL", "", "Redis for the replica registry and prewarm entries "
                             "('' = neither)")
    advertise_address: str = setting("KVPOP_ADVERTISE_ADDRESS", "",
                                     "host:port the gateway dials to reach this replica ('' = host:port)")
    heartbeat_s: float = setting("KVPOP_HEARTBEAT_S", 3.0, "registry entry lifetime; 3 heartbeats per interval")
    prewarm_top_k: int = setting("KVPOP_PREWARM_TOP_K", 8,
                                 "most-counted prompt prefixes prefilled before SERVING (0 = none)")
    prewarm_max_s: float = setting("KVPOP_PREWARM_MAX_S", 0.5,
                                   "most seconds of prewarm prefills before SERVING, most counted first; the rest "
                                   "are skipped (a restarted replica serves again within seconds)")
    session_kv_ttl_s: float = setting("KVPOP_SESSION_KV_TTL_S", 600.0,
                                      "seconds an idle session keeps its parked KV on this replica")
    pipeline_decode_plans: bool = setting("KVPOP_PIPELINE_DECODE_PLANS", False,
                                          "let a learned sequence decode within its slack while its plan comes "
                                          "(faster at block size 1; evictions then depend on timing)")
    cleanup_threshold: float = setting("KVPOP_CLEANUP_THRESHOLD", 0.7,
                                       "share of the pool that admissions may reserve before running budgets "
                                       "are shrunk to admit more ('inf' = never shrink: new requests wait)")
    plan_interval: int = setting("KVPOP_PLAN_INTERVAL", PLAN_INTERVAL,
                                 "tokens between a decoding `learned` sequence's eviction plans: its features "
                                 "go to the cache-manager in batches this long (prompt chunks always plan)")
    prefill_chunk: int = setting("KVPOP_PREFILL_CHUNK", PREFILL_CHUNK,
                                 "prompt tokens prefilled per engine step, all sequences together; a budget held "
                                 "during prefill is enforced after each chunk, so a request's peak KV is about its "
                                 "budget plus one chunk (smaller: lower peak, more eviction rounds and plans)")
    plan_wait_ms: float = setting("KVPOP_PLAN_WAIT_MS", 2000.0,
                                  "most a `learned` sequence waits for its eviction plan before compute's "
                                  "fallback ranks (only that sequence waits), per prefill chunk of blocks its "
                                  "round ranks")
    # Compute's own limits: whoever calls it (a gateway, or anyone holding the token) is held to them.
    max_prompt_chars: int = setting("KVPOP_MAX_PROMPT_CHARS", 65536,
                                    "longest prompt in characters (RESOURCE_EXHAUSTED beyond)")
    max_tokens_limit: int = setting("KVPOP_MAX_TOKENS_LIMIT", 4096,
                                    "largest max_tokens a request may ask for (RESOURCE_EXHAUSTED beyond)")
    max_streams: int = setting("KVPOP_MAX_COMPUTE_STREAMS", 1024,
                               "most Generate streams open on this compute replica at once, all callers together "
                               "(RESOURCE_EXHAUSTED beyond)")

    def validate(self) -> None:
        super().validate()
        if self.max_prompt_chars < 1 or self.max_tokens_limit < 1 or self.max_streams < 1:
            raise ConfigError("KVPOP_MAX_PROMPT_CHARS, KVPOP_MAX_TOKENS_LIMIT and KVPOP_MAX_COMPUTE_STREAMS "
                              "must be >= 1")
        if self.heartbeat_s <= 0 or self.prewarm_top_k < 0 or self.prewarm_max_s < 0:
            raise ConfigError("KVPOP_HEARTBEAT_S must be > 0, KVPOP_PREWARM_TOP_K and KVPOP_PREWARM_MAX_S >= 0")
        if self.session_kv_ttl_s <= 0:
            raise ConfigError("KVPOP_SESSION_KV_TTL_S must be > 0")
        if self.plan_interval < 1:
            raise ConfigError("KVPOP_PLAN_INTERVAL must be >= 1 (tokens)")
        if self.prefill_chunk < 1:
            raise ConfigError("KVPOP_PREFILL_CHUNK must be >= 1 (tokens)")
        if self.plan_wait_ms < 0:
            raise ConfigError("KVPOP_PLAN_WAIT_MS must be >= 0")
        if not self.cleanup_threshold > 0:
            raise ConfigError("KVPOP_CLEANUP_THRESHOLD must be > 0 (a share of the pool, or 'inf')")
        if self.block_size < 1:
            raise ConfigError("KVPOP_BLOCK_SIZE must be >= 1")
        if self.page_size < 1:
            raise ConfigError("KVPOP_PAGE_SIZE must be >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError("KVPOP_MAX_NUM_SEQS must be >= 1")


@dataclass
class GatewayConfig(ServerConfig):
    port: int = setting("KVPOP_GATEWAY_PORT", 50051, "public gateway port (0 = any free port)")
    metrics_port: int = setting("KVPOP_METRICS_PORT", 9091, "HTTP port of /metrics and /healthz "
                                "(0 = any free port, -1 = off)")
    compute_address: str = setting("KVPOP_COMPUTE_ADDRESS", "127.0.0.1:50052",
                                   "host:port of compute while no replica is registered in Redis")
    redis_url: str = setting("KVPOP_REDIS_URL", "", "Redis for sessions, replica registry and prewarm "
                             "counts ('' = none of them)")
    heartbeat_s: float = setting("KVPOP_HEARTBEAT_S", 3.0, "replica heartbeat interval (as compute's)")
    default_policy: str = setting("KVPOP_DEFAULT_POLICY", "learned", "policy when a request names none")
    default_budget: str = setting("KVPOP_DEFAULT_BUDGET", "0.25",
                                  "kv budget when a request sets none: tokens per (layer, kv-head) ('512'), "
                                  "a fraction of the request's prompt + max_tokens ('0.25') or '' (then every "
                                  "policy but dense needs one)")
    max_prompt_chars: int = setting("KVPOP_MAX_PROMPT_CHARS", 65536,
                                    "longest prompt in characters (RESOURCE_EXHAUSTED beyond)")
    max_tokens_limit: int = setting("KVPOP_MAX_TOKENS_LIMIT", 4096,
                                    "largest max_tokens a request may ask for (RESOURCE_EXHAUSTED beyond)")
    max_streams_per_client: int = setting("KVPOP_MAX_STREAMS_PER_CLIENT", 64,
                                          "most Generate streams one client may have open at once, the client "
                                          "being its x-client-id metadata, else its IP address "
                                          "(RESOURCE_EXHAUSTED beyond; 0 = no limit)")
    default_prefill: str = setting("KVPOP_DEFAULT_PREFILL", DEFAULT_PREFILL,
                                   "when a request's budget starts to hold if it sets neither evict_after_prompt nor "
                                   "prefill_allowance: held (from the first prompt chunk on: peak about budget + one "
                                   "chunk), after (from the prompt's end on: peak the whole prompt) or Nx (up to N "
                                   "times the budget during prefill); '' = kvpop/runtime/config.py's DEFAULT_PREFILL (docs/results/long-context.md)")
    default_max_tokens: int = setting("KVPOP_DEFAULT_MAX_TOKENS", 128, "max_tokens when a request sets none")
    max_stop_strings: int = setting("KVPOP_MAX_STOP_STRINGS", 8, "most stop strings per request")
    session_ttl_s: int = setting("KVPOP_SESSION_TTL_S", 86400, "seconds a session lives after its last use")
    # Who may call the public API (services/gateway/apikeys.py, docs/reference/api.md).
    api_keys_file: str = setting("KVPOP_API_KEYS_FILE", "", "file of API keys, one 'NAME sha256:HASH [limit=N ...]' "
                                 "a line (`kvpop keys new`); re-read when it changes. Calls then need "
                                 "'authorization: Bearer <key>' (UNAUTHENTICATED without); health and reflection "
                                 "stay open")
    api_keys: str = setting("KVPOP_API_KEYS", "", "the same lines in the variable itself, ';' between them "
                            "(fixed until restart; a Kubernetes Secret works as either)")
    allow_no_keys: bool = setting("KVPOP_ALLOW_NO_KEYS", False, "serve a non-loopback KVPOP_HOST without API "
                                  "keys (refused otherwise: anyone who reaches the port could use it and "
                                  "continue anyone's session)")
    key_requests_per_minute: int = setting("KVPOP_KEY_REQUESTS_PER_MINUTE", 0, "Generate calls one API key may "
                                           "start per minute unless its line says otherwise (0 = no limit)")
    key_tokens_per_minute: int = setting("KVPOP_KEY_TOKENS_PER_MINUTE", 0, "tokens one API key may have "
                                         "generated in the last minute before its next call is refused, unless "
                                         "its line says otherwise (0 = no limit)")
    public_tls_cert: str = setting("KVPOP_PUBLIC_TLS_CERT", "", "PEM certificate (chain) of the public port: "
                                   "serve TLS (with KVPOP_PUBLIC_TLS_KEY)")
    public_tls_key: str = setting("KVPOP_PUBLIC_TLS_KEY", "", "PEM private key of KVPOP_PUBLIC_TLS_CERT")
    public_tls_ca: str = setting("KVPOP_PUBLIC_TLS_CA", "", "PEM CA: require client certificates signed by it "
                                 "on the public port ('' = no client certificates)")

    def validate(self) -> None:
        super().validate()
        if not self.api_keys_file and not self.api_keys.strip() and not self.allow_no_keys \
                and not is_loopback(self.host):
            raise ConfigError(f"refusing to serve the public API on {self.host} without API keys: anyone who "
                              f"reaches the port could use it. Set KVPOP_API_KEYS_FILE (make one with "
                              f"`kvpop keys new NAME --file FILE`), bind 127.0.0.1, or opt out with "
                              f"KVPOP_ALLOW_NO_KEYS=true (--allow-no-keys true)")
        if self.key_requests_per_minute < 0 or self.key_tokens_per_minute < 0:
            raise ConfigError("KVPOP_KEY_REQUESTS_PER_MINUTE and KVPOP_KEY_TOKENS_PER_MINUTE must be >= 0 "
                              "(0 = no limit)")
        if not 0 < self.default_max_tokens <= self.max_tokens_limit:
            raise ConfigError("KVPOP_DEFAULT_MAX_TOKENS must be in [1, KVPOP_MAX_TOKENS_LIMIT]")
        if self.default_budget:
            try:
                v = self.budget()
            except ValueError:
                raise ConfigError(f"KVPOP_DEFAULT_BUDGET={self.default_budget!r}: not a number") from None
            if (isinstance(v, float) and not 0 < v <= 1) or (isinstance(v, int) and v < 1):
                raise ConfigError("KVPOP_DEFAULT_BUDGET: a fraction in (0, 1] or tokens >= 1")
        if self.max_prompt_chars < 1 or self.session_ttl_s < 1:
            raise ConfigError("KVPOP_MAX_PROMPT_CHARS and KVPOP_SESSION_TTL_S must be >= 1")
        if self.heartbeat_s <= 0:
            raise ConfigError("KVPOP_HEARTBEAT_S must be > 0")
        if self.max_streams_per_client < 0:
            raise ConfigError("KVPOP_MAX_STREAMS_PER_CLIENT must be >= 0 (0 = no limit)")
        try:
            self.prefill()
        except ValueError as e:
            raise ConfigError(f"KVPOP_DEFAULT_PREFILL: {e}") from None

    def prefill(self) -> tuple[bool, float]:
        """The default prefill protocol's (evict_after_prompt, prefill_allowance)."""
        return prefill_protocol.parse(self.default_prefill.strip() or DEFAULT_PREFILL)


    def budget(self) -> int | float | None:
        b = self.default_budget.strip()
        if not b:
            return None
        return float(b) if any(c in b for c in ".eE") else int(b)


C = TypeVar("C", bound=ServerConfig)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` ('localhost', 127.0.0.0/8, ::1)."""
    import ipaddress

    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type[ServerConfig]) -> None:
    for f in dataclasses.fields(cls):
        md = f.metadata
        parser.add_argument(_flag(f), dest=f.name, default=None, metavar=md["env"],
                            help=f"{md['help']} [env {md['env']}, default {f.default!r}]")


def load(cls: type[C], args: argparse.Namespace | None = None,
         env: Mapping[str, str] | None = None) -> C:
    """Flags over environment over defaults; raises ConfigError naming the culprit."""
    env = os.environ if env is None else env
    values = {}
    for f in dataclasses.fields(cls):
        md = f.metadata
        raw, where = getattr(args, f.name, None) if args is not None else None, _flag(f)
        if raw is None and md["env"] in env:
            raw, where = env[md["env"]], md["env"]
        if raw is None:
            values[f.name] = f.default
            continue
        try:
            values[f.name] = md["parse"](raw)
        except ValueError as e:
            raise ConfigError(f"{where}={raw!r}: {e}") from None
    cfg = cls(**values)
    cfg.validate()
    return cfg


def describe() -> str:
    """Markdown table of every setting of every service."""
    rows = ["| variable | flag | default | service | meaning |", "| --- | --- | --- | --- | --- |"]
    seen: set[str] = set()
    for cls, svc in ((ServerConfig, "all"), (GatewayConfig, "gateway"), (ComputeConfig, "compute"),
                     (CacheManagerConfig, "cache-manager")):
        for f in dataclasses.fields(cls):
            if f.metadata["env"] in seen:
                continue
            seen.add(f.metadata["env"])
            rows.append(f"| `{f.metadata['env']}` | `{_flag(f)}` | `{f.default!r}` | {svc} | {f.metadata['help']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(describe())
    sys.exit(0)
