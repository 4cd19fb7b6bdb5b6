"""The Python Language Reference's prose, as the standard library ships it for
pydoc (pydoc_data.topics), as sentences. HELD OUT: never in training."""
from __future__ import annotations

from kvpop.tasks.sources.corpus import sentences

SEP = " "


def units() -> list[str]:
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        # Prose only: indented blocks are grammar rules and examples.
        out += sentences("\n".join(ln for ln in topics[key].splitlines() if not ln.startswith(" ")))
    return out
