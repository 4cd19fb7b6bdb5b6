"""Request validation: every public field checked, one clear gRPC status and
message per problem; a valid request is resolved into compute's narrow request.

| problem | status |
| --- | --- |
| neither prompt nor messages, or both; a message role other than system/user/assistant; messages for a model without a chat template; prompt turns and chat turns in one session (services/gateway/chats.py); empty prompt; max_tokens < 1; seed >= 2^63; temperature not in [0, 100]; top_p not in (0, 1]; top_k < 0; repetition_penalty not in (0, 100]; unknown policy; budget_tokens not in [1, max_model_len]; budget_fraction not in (0, 1]; sink_tokens or recent_tokens not in [0, max_model_len]; prefill_allowance not in [1, 64] or with evict_after_prompt; too many / empty / long stop strings; malformed session_id or request_id | INVALID_ARGUMENT |
| request bytes that do not parse (services/gateway/decoding.py); malformed x-client-id metadata | INVALID_ARGUMENT |
| prompt (or all message contents together) longer than KVPOP_MAX_PROMPT_CHARS; max_tokens over KVPOP_MAX_TOKENS_LIMIT; the client already has KVPOP_MAX_STREAMS_PER_CLIENT streams open (services/gateway/limits.py); message larger than KVPOP_MAX_MESSAGE_BYTES (gRPC itself) | RESOURCE_EXHAUSTED |
"""
from __future__ import annotations

import math
import re
import uuid

import grpc

from kvpop.runtime.config import MAX_PREFILL_ALLOWANCE, GatewayConfig
from kvpop.runtime.pb import compute_pb2, generate_pb2

MAX_STOP_CHARS = 256
CHAT_ROLES = ("system", "user", "assistant")
# Use with fullmatch: "^...$" with match() would let a trailing newline through.
ID_PATTERN = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")


class Invalid(Exception):
    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code, self.message = code, message


def _check_float(name: str, value: float, lo: float, hi: float, lo_open: bool) -> None:
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise Invalid(f"{name} must be in {interval}, got {value!r}")


def validate(req: generate_pb2.GenerateRequest, cfg: GatewayConfig,
             info: generate_pb2.ModelInfo) -> compute_pb2.ComputeRequest:
    if req.messages:
        _check_messages(req, cfg, info)
    elif not req.prompt:
        raise Invalid("prompt must not be empty (or send messages: a chat)")
    elif len(req.prompt) > cfg.max_prompt_chars:
        raise Invalid(f"prompt has {len(req.prompt)} characters; the limit is {cfg.max_prompt_chars} "
                      f"(KVPOP_MAX_PROMPT_CHARS)", grpc.StatusCode.RESOURCE_EXHAUSTED)

    s = compute_pb2.Sampling(max_tokens=cfg.default_max_tokens, temperature=0.0, top_p=1.0, top_k=0,
                             repetition_penalty=1.0, ignore_eos=req.ignore_eos, logprobs=req.logprobs)
    if req.HasField("max_tokens"):
        if req.max_tokens < 1:
            raise Invalid(f"max_tokens must be in [1, {cfg.max_tokens_limit}], got {req.max_tokens}")
        if req.max_tokens > cfg.max_tokens_limit:
            raise Invalid(f"max_tokens is {req.max_tokens}; the limit is {cfg.max_tokens_limit} "
                          f"(KVPOP_MAX_TOKENS_LIMIT)", grpc.StatusCode.RESOURCE_EXHAUSTED)
        s.max_tokens = req.max_tokens
    if req.HasField("temperature"):
        _check_float("temperature", req.temperature, 0.0, 100.0, lo_open=False)
        s.temperature = req.temperature
    if req.HasField("top_p"):
        _check_float("top_p", req.top_p, 0.0, 1.0, lo_open=True)
        s.top_p = req.top_p
    if req.HasField("top_k"):
        if req.top_k < 0:
            raise Invalid(f"top_k must be >= 0 (0 = off), got {req.top_k}")
        s.top_k = req.top_k
    if req.HasField("repetition_penalty"):
        _check_float("repetition_penalty", req.repetition_penalty, 0.0, 100.0, lo_open=True)
        s.repetition_penalty = req.repetition_penalty
    if req.HasField("seed"):
        if req.seed >= 2**63:
            raise Invalid(f"seed must be in [0, 2^63 - 1], got {req.seed}")
        s.has_seed, s.seed = True, req.seed
    if len(req.stop) > cfg.max_stop_strings:
        raise Invalid(f"at most {cfg.max_stop_strings} stop strings, got {len(req.stop)}")
    for stop in req.stop:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise Invalid(f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(stop)}")
    s.stop.extend(req.stop)

    policy = req.policy or cfg.default_policy
    if policy not in info.policies:
        shown = repr(policy[:40]) + ("..." if len(policy) > 40 else "")     # a status message stays small
        raise Invalid(f"unknown policy {shown}; one of: {', '.join(info.policies)}")
    ev = compute_pb2.Eviction(policy=policy)
    which = req.WhichOneof("kv_budget")
    if which == "budget_tokens":
        if not 1 <= req.budget_tokens <= info.max_model_len:
            raise Invalid(f"budget_tokens must be in [1, {info.max_model_len}] (the model's max length), "
                          f"got {req.budget_tokens}")
        ev.budget_tokens = req.budget_tokens
    elif which == "budget_fraction":
        _check_float("budget_fraction", req.budget_fraction, 0.0, 1.0, lo_open=True)
        ev.budget_fraction = req.budget_fraction
    elif policy != "dense" and cfg.budget() is not None:
        default = cfg.budget()
        if isinstance(default, float):
            ev.budget_fraction = default
        else:
            ev.budget_tokens = min(default, info.max_model_len)
    elif policy != "dense":
        raise Invalid(f"policy {policy!r} needs a kv budget (budget_tokens or budget_fraction)")
    for name in ("sink_tokens", "recent_tokens"):
        if req.HasField(name):
            value = getattr(req, name)
            if not 0 <= value <= info.max_model_len:
                raise Invalid(f"{name} must be in [0, {info.max_model_len}] (the model's max length), got {value}")
            setattr(ev, name, value)
    ev.evict_after_prompt = req.evict_after_prompt
    if not req.evict_after_prompt and not req.HasField("prefill_allowance"):
        # Neither says when the budget starts to hold: the stack's default protocol
        # (KVPOP_DEFAULT_PREFILL). prefill_allowance=1 asks for the budget held during prefill.
        ev.evict_after_prompt, allowance = cfg.prefill()
        if allowance > 1.0:
            ev.prefill_allowance = allowance
    elif req.HasField("prefill_allowance"):
        _check_float("prefill_allowance", req.prefill_allowance, 1.0, MAX_PREFILL_ALLOWANCE, lo_open=False)
        if req.prefill_allowance > 1.0 and req.evict_after_prompt:
            raise Invalid("prefill_allowance and evict_after_prompt exclude each other: evict_after_prompt "
                          "already holds the whole prompt during prefill")
        ev.prefill_allowance = req.prefill_allowance

    for name in ("session_id", "request_id"):
        value = getattr(req, name)
        if value and not ID_PATTERN.fullmatch(value):
            raise Invalid(f"{name} must be 1-128 characters of [A-Za-z0-9._:@/-], got {value[:40]!r}")
    return compute_pb2.ComputeRequest(request_id=req.request_id or uuid.uuid4().hex, prompt=req.prompt,
                                      sampling=s, eviction=ev, session_id=req.session_id,
                                      messages=req.messages)


def _check_messages(req: generate_pb2.GenerateRequest, cfg: GatewayConfig, info: generate_pb2.ModelInfo) -> None:
    if req.prompt:
        raise Invalid("set either prompt or messages, not both")
    if not info.chat_template:
        raise Invalid(f"the served model ({info.name}) has no chat template, so it takes no messages: "
                      f"send a prompt instead")
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            shown = repr(m.role[:40]) + ("..." if len(m.role) > 40 else "")
            raise Invalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {shown}")
    chars = sum(len(m.content) for m in req.messages)
    if chars > cfg.max_prompt_chars:
        raise Invalid(f"messages have {chars} characters of content; the limit is {cfg.max_prompt_chars} "
                      f"(KVPOP_MAX_PROMPT_CHARS)", grpc.StatusCode.RESOURCE_EXHAUSTED)
