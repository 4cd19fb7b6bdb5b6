"""What one stream carried, read off compute's responses as they pass through
the gateway: the text and tokens a session stores as its turn, the finish, and
the usage the request's log line and metrics report."""
from __future__ import annotations

from kvpop.runtime.pb import compute_pb2, generate_pb2
from kvpop.runtime.session_store import Turn

_FINISH_WORDS = {generate_pb2.FINISH_REASON_LENGTH: "length", generate_pb2.FINISH_REASON_EOS: "eos",
                 generate_pb2.FINISH_REASON_STOP: "stop", generate_pb2.FINISH_REASON_ABORTED: "aborted"}


class Streamed:
    def __init__(self):
        self.text: list[str] = []
        self.ids: list[int] = []
        self.prompt_ids: list[int] = []
        self.finish = ""
        self.usage: generate_pb2.Usage | None = None

    def add(self, resp: compute_pb2.ComputeResponse) -> int:
        """Reads one response; returns the tokens its chunk carried."""
        if resp.prompt_token_ids:
            self.prompt_ids = list(resp.prompt_token_ids)
        r = resp.response
        if r.HasField("chunk"):
            self.text.append(r.chunk.text)
            self.ids.extend(r.chunk.token_ids)
            return len(r.chunk.token_ids)
        if r.HasField("finished"):
            self.finish = _FINISH_WORDS.get(r.finished.finish_reason, r.finished.finish_reason_text)
            self.usage = r.finished.usage
        return 0

    def note(self, sid: str, key: str | None) -> str:
        """The log line's tail: how the session went on, and whose key asked."""
        out = ""
        if sid and self.usage is not None:
            u = self.usage
            out = (f", session {sid} resumed" if u.session_resumed else
                   f", session {sid} re-prefilled {u.reprefilled_tokens} tokens" if u.reprefilled_tokens
                   else f", session {sid} started")
        if key is not None and self.usage is not None:
            out += f", key {key}"
        return out

    def turn(self, request_id: str, prompt: str, messages: list[dict]) -> Turn:
        return Turn(request_id=request_id, prompt=prompt, completion="".join(self.text),
                    prompt_token_ids=self.prompt_ids, completion_token_ids=self.ids, finish_reason=self.finish,
                    messages=messages)
