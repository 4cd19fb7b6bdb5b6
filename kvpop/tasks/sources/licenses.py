"""Licence texts: the common licences every Debian-based system ships in
/usr/share/common-licenses (base-files), each text once, as sentences.
HELD OUT: never in training."""
from __future__ import annotations

from pathlib import Path

from kvpop.tasks.sources.corpus import sentences

SEP = " "
FOLDER = Path("/usr/share/common-licenses")


def units() -> list[str]:
    if not FOLDER.is_dir():
        raise OSError(f"no {FOLDER} (a Debian-based system ships it)")
    seen, out = set(), []
    for path in sorted(FOLDER.iterdir()):
        real = path.resolve()      # GPL -> GPL-3 and the like: each text once
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        out += sentences(real.read_text(encoding="utf-8", errors="replace"))
    return out
