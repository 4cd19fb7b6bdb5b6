"""The docs against the repository: every relative link and anchor resolves,
no file narrates the process that made it, every public API field is in
docs/reference/api.md, and the CLI reference is what the parsers say."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.common import REPO

# The repository speaks of the product: history lives in git, not in files.
HISTORY = re.compile(r"session [0-9]|attempt [0-9]|issue #?[0-9]", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def tracked_files() -> list[Path]:
    """Files git tracks here, or every file outside hidden and build folders when there is no git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
        names = [n for n in out.stdout.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                 if p.is_file() and not any(part.startswith(".") or part in ("runs", "node_modules")
                                            for part in p.relative_to(REPO).parts)]
    return [REPO / n for n in names if (REPO / n).is_file()]


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None     # binary: weights, images
    return data.decode("utf-8", errors="replace")


def test_no_file_narrates_the_process():
    hits = []
    for path in tracked_files():
        text = text_of(path)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert not hits, "process history in the repository (it belongs in git):\n" + "\n".join(hits[:50])


@pytest.mark.parametrize("line, narrates", [
    # Numbers spliced in, so that this file does not match its own test.
    (f"Tried in session {16}, see below", True),
    (f"attempt {57} ships", True),
    (f"see issue #{12} and Issue {3}", True),
    ("a session_id of 1-128 characters", False),
    ("session resumed; 3 attempts at most", False),
    ("gRPC status 14 (UNAVAILABLE)", False),
])
def test_the_history_pattern_is_the_spec(line, narrates):
    assert bool(HISTORY.search(line)) == narrates


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in md.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        slug = github_slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(md: Path):
    fenced = False
    for n, line in enumerate(md.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            for m in LINK.finditer(line):
                yield n, m.group(1)


def markdown_files() -> list[Path]:
    return [p for p in tracked_files() if p.suffix == ".md"]


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for md in markdown_files():
        for n, target in links(md):
            if re.match(r"[a-z]+:", target):
                continue        # http(s), mailto: not ours to check offline
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(REPO)}:{n}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_doc_is_reachable_from_the_docs_index():
    index = REPO / "docs" / "README.md"
    reached = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index) if not re.match(r"[a-z]+:", t)}
    pages = {p.resolve() for p in (REPO / "docs").rglob("*.md") if p != index}
    assert not pages - reached, sorted(str(p.relative_to(REPO)) for p in pages - reached)


def test_every_public_api_field_is_documented():
    from kvpop.runtime.pb import generate_pb2

    doc = (REPO / "docs" / "reference" / "api.md").read_text()
    missing = [f"{msg.name}.{field.name}" for msg in generate_pb2.DESCRIPTOR.message_types_by_name.values()
               for field in msg.fields if f"`{field.name}`" not in doc]
    assert not missing, f"fields of protos/kvpop/v1/generate.proto missing from docs/reference/api.md: {missing}"


def test_the_cli_reference_is_what_the_parsers_say():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "cli_reference.py"), "--check"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout


def test_every_metric_is_in_the_metrics_reference():
    from prometheus_client import CollectorRegistry

    from kvpop.runtime.metrics import Metrics
    from services.gateway.key_metrics import KeyMetrics

    doc = (REPO / "docs" / "reference" / "metrics.md").read_text()
    KeyMetrics()   # registers into the process's registry
    from kvpop.runtime.metrics import get_metrics
    names = set()
    for registry in (Metrics(CollectorRegistry(), process_collectors=False).registry, get_metrics().registry):
        for fam in registry.collect():
            if fam.name.startswith("kvpop_"):
                names.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    assert len(names) > 25
    missing = sorted(n for n in names if f"`{n}" not in doc and f"{n.rsplit('_', 1)[0]}_" not in doc)
    assert not missing, f"metrics not in docs/reference/metrics.md: {missing}"
