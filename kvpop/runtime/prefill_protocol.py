"""When a request's KV budget starts to hold: the prefill protocol.

- ``held``: from the first prompt chunk on; the peak KV is about the budget
  plus one prefill chunk, and the prompt is ranked a chunk at a time, before
  the question at its end has been read.
- ``<N>x`` (a prefill allowance, 1 < N <= MAX_PREFILL_ALLOWANCE): up to N times
  the budget during prefill, the budget from the end of the prompt on.
- ``after``: the whole prompt during prefill, the budget from its end on (the
  request's `evict_after_prompt`; kvpress's protocol): the peak is the whole
  prompt, as dense's, and the ranking sees the question.

kvpop.runtime.config.DEFAULT_PREFILL is what a request gets when it sets neither
`evict_after_prompt` nor `prefill_allowance` (the gateway's
KVPOP_DEFAULT_PREFILL; the eval's and the benchmarks' labels without a suffix).
"""
from __future__ import annotations

# The largest prefill_allowance a request may ask (a multiple of its budget).
MAX_PREFILL_ALLOWANCE = 64.0

HELD, AFTER = "held", "after"


def parse(text: str) -> tuple[bool, float]:
    """A protocol's (evict_after_prompt, prefill_allowance)."""
    t = text.strip().lower()
    if t == HELD:
        return False, 1.0
    if t == AFTER:
        return True, 1.0
    try:
        if not t.endswith("x"):
            raise ValueError
        n = float(t[:-1])
    except ValueError:
        raise ValueError(f"a prefill protocol is {HELD}, {AFTER} or <N>x (a prefill allowance), "
                         f"got {text!r}") from None
    if not 1.0 <= n <= MAX_PREFILL_ALLOWANCE:
        raise ValueError(f"a prefill allowance must be in [1, {MAX_PREFILL_ALLOWANCE:g}]x, got {text!r}")
    return False, n
