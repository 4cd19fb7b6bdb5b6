"""Source code: the standard library's .py files, line by line (a training
source). Blank lines and comment-only lines are kept out: a unit is a line
that says something."""
from __future__ import annotations

from kvpop.tasks.sources import stdlib_files

SEP = "\n"


def units() -> list[str]:
    out = []
    for path in stdlib_files.files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        out += [ln.rstrip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return out
