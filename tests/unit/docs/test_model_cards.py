"""Each shipped value-estimation network has a card generated from its
checkpoint's metadata, and a card that no longer matches its metadata is caught."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

from kvpop.runtime.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "model_cards.py"


def cards(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_every_shipped_card_is_what_its_metadata_gives():
    shipped = sorted([*(REPO_ROOT / "models/default").glob("estimator*.json"),
                      *(REPO_ROOT / "kvpop/estimators").glob("*.json")])
    assert len(shipped) == 5
    assert all(m.with_suffix(".card.md").exists() for m in shipped)
    r = cards("--check")
    assert r.returncode == 0, r.stderr


def test_a_card_follows_its_metadata(tmp_path):
    meta = tmp_path / "estimator-bs16.json"
    shutil.copy(REPO_ROOT / "models/default/estimator-bs16.json", meta)
    assert cards(meta).returncode == 0
    card = (tmp_path / "estimator-bs16.card.md").read_text()
    assert "| serves block sizes | 16 |" in card and "1,921 tokens" in card
    assert "| this network | 0.890 |" in card      # held-out mass@k at keep 1/2, from the metadata
    d = json.loads(meta.read_text())
    d["max_context"] = 4096
    meta.write_text(json.dumps(d))
    r = cards("--check", meta)
    assert r.returncode == 1 and "out of date" in r.stderr
