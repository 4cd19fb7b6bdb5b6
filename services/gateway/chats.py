"""Chat sessions: a session whose turns are chat messages.

Redis holds every turn's new messages and the assistant's reply (kvpop/runtime/session_store.py),
so each turn the gateway hands compute the conversation so far
(`chat_history`) with only the turn's new messages: compute renders the
template's difference between the two and appends it to the session's KV, or
to its re-prefilled token history on another replica. A client may also
resend the whole conversation each turn (as for a stateless server): the part
the session already holds is recognised and skipped.
"""
from __future__ import annotations

from kvpop.runtime.pb import compute_pb2, generate_pb2
from kvpop.runtime.session_store import Session, Turn
from services.gateway.validation import Invalid


def conversation(turns: list[Turn]) -> list[dict]:
    """The chat a session's turns hold: each turn's messages, then its reply."""
    return [m for t in turns for m in (*t.messages, {"role": "assistant", "content": t.completion})]


def check_kind(request: generate_pb2.GenerateRequest, session: Session | None) -> None:
    """A session is a chat or a text session from its first turn on."""
    if session is None or not session.turns:
        return
    if session.chat and not request.messages:
        raise Invalid(f"session {request.session_id!r} is a chat: continue it with messages, not a prompt")
    if request.messages and not session.chat:
        raise Invalid(f"session {request.session_id!r} holds prompt turns: continue it with a prompt, "
                      f"or start a chat under another session_id")


def continue_chat(creq: compute_pb2.ComputeRequest, turns: list[Turn]) -> list[dict]:
    """Fill `creq` with the conversation so far and only the turn's new
    messages; return those new messages (what the turn stores)."""
    held = conversation(turns)
    sent = [{"role": m.role, "content": m.content} for m in creq.messages]
    if held and len(sent) > len(held) and sent[:len(held)] == held:
        sent = sent[len(held):]     # the whole conversation resent: only its new part is the turn
    if held:
        if not turns[-1].completion_token_ids:
            raise Invalid(f"session {creq.session_id!r}: its last turn produced no reply to continue from")
        if any(m["role"] == "assistant" for m in sent[:1]):
            raise Invalid("a chat turn's new messages follow the assistant's reply: they cannot start "
                          "with another assistant message")
        creq.chat_history.extend(generate_pb2.ChatMessage(**m) for m in held)
        if turns[-1].finish_reason == "eos":
            creq.reply_end_token_id = turns[-1].completion_token_ids[-1]
    del creq.messages[:]
    creq.messages.extend(generate_pb2.ChatMessage(**m) for m in sent)
    return sent
