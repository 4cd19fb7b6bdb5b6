"""Dialogue: the English conversations of the chatterbot-corpus package
(BSD-3-Clause; the `text` extra), one turn a unit, speakers alternating
(a training source)."""
from __future__ import annotations

from pathlib import Path

SEP = "\n"
_SPEAKERS = ("A", "B")


def units() -> list[str]:
    import yaml

    try:
        import chatterbot_corpus
    except ImportError as e:
        raise ImportError("the dialogue source needs chatterbot-corpus: pip install 'kvpop-serving[text]'") from e
    folder = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    out = []
    for path in sorted(folder.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conv in data.get("conversations", []):
            conv = [conv] if isinstance(conv, str) else conv     # a few files hold bare strings
            turns = [" ".join(str(t).split()) for t in conv if str(t).strip()]
            out += [f"{_SPEAKERS[i % 2]}: {t}" for i, t in enumerate(turns)]
    return out
