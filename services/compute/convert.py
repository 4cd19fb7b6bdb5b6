"""Between compute's protobuf messages and the engine's types: the one place
the servicer's requests become engine parameters and the engine's outputs
become response messages."""
from __future__ import annotations

from kvpop.runtime.pb import compute_pb2, generate_pb2
from services.compute.eviction.budget import EvictionParams
from services.compute.engine.engine import StepOutput, Usage
from services.compute.model.sampler import SamplingParams

_FINISH = {"length": generate_pb2.FINISH_REASON_LENGTH, "stop": generate_pb2.FINISH_REASON_STOP,
           "eos": generate_pb2.FINISH_REASON_EOS, "abort": generate_pb2.FINISH_REASON_ABORTED}


def sampling_params(s: compute_pb2.Sampling, room: int, resume_session: bool) -> SamplingParams:
    """``room``: tokens left in the model's length; a request asking more ends with
    "length", not an error. ``resume_session``: the prompt was tokenized as a
    continuation, so a session that expires before admission fails, never starts fresh."""
    return SamplingParams(max_tokens=max(1, min(s.max_tokens, room)), temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k, seed=s.seed if s.has_seed else None,
                          repetition_penalty=s.repetition_penalty, stop=tuple(s.stop), ignore_eos=s.ignore_eos,
                          logprobs=s.logprobs, resume_session=resume_session)


def eviction_params(ev: compute_pb2.Eviction) -> EvictionParams:
    """Unset fields take EvictionParams' defaults; no budget is dense."""
    which = ev.WhichOneof("budget")
    budget = ev.budget_tokens if which == "budget_tokens" else ev.budget_fraction if which else None
    return EvictionParams(policy=ev.policy or "dense", budget=budget,
                          sink=ev.sink_tokens if ev.HasField("sink_tokens") else EvictionParams.sink,
                          recent=ev.recent_tokens if ev.HasField("recent_tokens") else EvictionParams.recent,
                          after_prompt=ev.evict_after_prompt,
                          prefill_allowance=ev.prefill_allowance or EvictionParams.prefill_allowance)


def budget_holds(e: EvictionParams) -> str:
    """When the budget holds (it decides the request's peak KV): a span attribute."""
    if e.after_prompt:
        return "after_prompt"
    return f"prefill_x{e.prefill_allowance:g}" if e.prefill_allowance > 1 else "prefill"


def response(request_id: str) -> compute_pb2.ComputeResponse:
    return compute_pb2.ComputeResponse(response=generate_pb2.GenerateResponse(request_id=request_id))


def chunk(request_id: str, batch: list[StepOutput], logprobs: bool) -> compute_pb2.ComputeResponse:
    """One message for a batch of outputs (several tokens when the stream lags the
    engine); no chunk field when the batch carries neither a token nor text."""
    resp = response(request_id)
    c, text = resp.response.chunk, []
    for out in batch:
        if out.token_id is not None:
            c.token_ids.append(out.token_id)
            if logprobs and out.logprob is not None:
                c.logprobs.append(float(out.logprob))
        text.append(out.text_delta)
    c.text = "".join(text)
    if not c.token_ids and not c.text:
        resp.response.ClearField("chunk")
    return resp


def finish_reason(last: StepOutput, eos_ids, ignore_eos: bool) -> str:
    """The engine's reason, with a stop on an end-of-sequence token told apart as "eos"."""
    reason = last.finish_reason or ""
    if reason == "stop" and last.token_id in eos_ids and not ignore_eos:
        return "eos"
    return reason


def finish(resp: compute_pb2.ComputeResponse, reason: str, u: Usage | None, reprefilled: int) -> None:
    """Makes ``resp`` the stream's last message. ``reprefilled``: tokens of a session's stored
    history prefilled again before the turn; they are the session's, not the turn's prompt."""
    f = resp.response.finished
    f.finish_reason = _FINISH.get(reason, generate_pb2.FINISH_REASON_UNSPECIFIED)
    f.finish_reason_text = reason
    if u is not None:
        f.usage.CopyFrom(generate_pb2.Usage(
            prompt_tokens=u.prompt_tokens - reprefilled, completion_tokens=u.completion_tokens,
            kv_blocks_resident=u.kv_blocks_resident, kv_blocks_evicted=u.kv_blocks_evicted,
            policy=u.policy, fallback_evictions=u.fallback_evictions,
            session_resumed=u.session_tokens > 0, reprefilled_tokens=reprefilled,
            network_evictions=u.network_evictions, advisor_heuristic_evictions=u.advisor_heuristic_evictions,
            fallback_reasons=u.fallback_reasons, kv_blocks_peak=u.kv_blocks_peak))
