"""A sequence's text as it streams: each sampled token's text delta, with
stop strings cut out and a tail held back while it could still become one
(a client must never see the start of a stop string that then completes).
State lives on the sequence (`text`, `emitted`, `decoder`)."""
from __future__ import annotations

from services.compute.engine.sequence import Sequence


def push(seq: Sequence, tok: int) -> tuple[str, bool]:
    """Append ``tok``'s text; (the delta to send now, whether a stop string ended it)."""
    if seq.decoder is None:
        return "", False
    seq.text += seq.decoder.push(tok)
    stops = seq.sampling.stop
    if not stops:
        delta, seq.emitted = seq.text[seq.emitted:], len(seq.text)
        return delta, False
    start = max(0, seq.emitted - max(map(len, stops)) + 1)
    hits = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
    if hits:
        end = max(min(hits), seq.emitted)
        delta, seq.emitted = seq.text[seq.emitted:end], len(seq.text)
        return delta, True
    hold = max((k for s in stops for k in range(1, len(s)) if seq.text.endswith(s[:k])), default=0)
    end = max(seq.emitted, len(seq.text) - hold)
    delta, seq.emitted = seq.text[seq.emitted:end], end
    return delta, False


def flush(seq: Sequence) -> str:
    """The rest of the text at the end (what the decoder and the hold kept back)."""
    if seq.decoder is None:
        return ""
    seq.text += seq.decoder.flush()
    delta, seq.emitted = seq.text[seq.emitted:], len(seq.text)
    return delta
