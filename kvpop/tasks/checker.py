"""Exact-match answer checking that never raises on malformed model output."""
from __future__ import annotations

from kvpop.tasks.instance import Instance


def extract_answer(family: str, generated: str) -> str | None:
    """The final answer in a generation, or None when there is none.
    Generation is cut at the first `.` (the end-of-solution mark); arithmetic
    answers are the token after the last `ans`."""
    if not isinstance(generated, str):
        return None
    words = generated.replace("</s>", " ").split()
    if "." not in words:
        return None  # never finished its answer
    words = words[: words.index(".")]
    if family == "arithmetic":
        if "ans" not in words:
            return None
        i = len(words) - 1 - words[::-1].index("ans")
        rest = words[i + 1:]
        return rest[0] if len(rest) == 1 else None
    return " ".join(words) if words else None


def is_correct(instance: Instance, generated: str) -> bool:
    """Exact match of the task's answer; an instance with its own scoring
    (real-text retrieval: every expected value contained) uses that."""
    if hasattr(instance, "check"):
        return instance.check(generated)
    got = extract_answer(instance.family, generated)
    return got is not None and got == instance.answer
