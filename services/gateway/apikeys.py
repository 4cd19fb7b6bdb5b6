"""API keys of the public gateway: who may call it, under which name and limits.

A key list is text, one key a line (the file KVPOP_API_KEYS_FILE, or the
variable KVPOP_API_KEYS where `;` also ends a line):

    # name   hash                                  optional per-key limits
    alice    sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    batch    sha256:60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752  streams=2 requests_per_minute=60

Only the SHA-256 of a key is stored. Keys are long random strings (`kvpop
keys new`: 256 bits), so a fast hash is as safe as a slow one and keeps the
check cheap on every call. A presented key is hashed and compared with every
stored hash in constant time (hmac.compare_digest, no early exit).

The file is read again whenever it changes (its size, mtime or inode), at the
next call: adding or revoking a key needs no restart. A file that does not
parse keeps the previous keys (logged); at start it stops the gateway.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvpop.runtime.config import ConfigError

log = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
HASH_PATTERN = re.compile(r"sha256:([0-9a-f]{64})")
KEY_PREFIX = "kvpop-"
# Per-key limits a line may set (0 = no limit); unset ones take the gateway's defaults.
LIMITS = ("streams", "requests_per_minute", "tokens_per_minute", "max_tokens")


class KeyFileError(ConfigError):
    """A key list that does not parse; the message names the line."""


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes
    limits: dict[str, int] = field(default_factory=dict, compare=False, hash=False)


def hash_key(key: str) -> str:
    """The line form of a key's hash: `sha256:<hex>`."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def parse(text: str, source: str) -> list[ApiKey]:
    keys: dict[str, ApiKey] = {}
    for n, raw in enumerate(re.split(r"[\n;]", text), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}: entry {n}"
        parts = line.split()
        if len(parts) < 2:
            raise KeyFileError(f"{where}: expected 'NAME sha256:HEX [limit=N ...]', got {line[:60]!r}")
        name, digest, *extra = parts
        if not NAME_PATTERN.fullmatch(name):
            raise KeyFileError(f"{where}: key name must be 1-64 characters of [A-Za-z0-9._-], got {name[:40]!r}")
        if name in keys:
            raise KeyFileError(f"{where}: key name {name!r} appears twice")
        m = HASH_PATTERN.fullmatch(digest)
        if m is None:
            raise KeyFileError(f"{where}: {name}: expected sha256:<64 lowercase hex digits> (the key's hash, "
                               f"never the key; `kvpop keys hash` prints it)")
        limits = {}
        for item in extra:
            k, _, v = item.partition("=")
            if k not in LIMITS or not v.isdigit():
                raise KeyFileError(f"{where}: {name}: {item!r} is not one of "
                                   f"{', '.join(f'{x}=N' for x in LIMITS)}")
            limits[k] = int(v)
        keys[name] = ApiKey(name, bytes.fromhex(m.group(1)), limits)
    return list(keys.values())


class KeyRing:
    """The configured keys; `identify(presented)` -> ApiKey or None."""

    def __init__(self, path: str = "", inline: str = ""):
        if path and inline:
            raise KeyFileError("set KVPOP_API_KEYS_FILE or KVPOP_API_KEYS, not both")
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self.keys: list[ApiKey] = parse(inline, "KVPOP_API_KEYS") if inline.strip() else []
        if inline.strip() and not self.keys:
            raise KeyFileError("KVPOP_API_KEYS has no keys in it (only comments)")
        if self.path is not None:
            self.keys = self._read(self._stat())
            if not self.keys:
                raise KeyFileError(f"KVPOP_API_KEYS_FILE={self.path}: no keys in it "
                                   f"(add one: kvpop keys new NAME --file {self.path})")

    @property
    def enabled(self) -> bool:
        return self.path is not None or bool(self.keys)

    def _stat(self) -> tuple:
        try:
            st = self.path.stat()
        except OSError as e:
            raise KeyFileError(f"KVPOP_API_KEYS_FILE={self.path}: cannot read ({e.strerror}); "
                               f"make one with: kvpop keys new NAME --file {self.path}") from e
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _read(self, stamp: tuple) -> list[ApiKey]:
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise KeyFileError(f"KVPOP_API_KEYS_FILE={self.path}: cannot read ({e})") from e
        keys = parse(text, str(self.path))
        self._stamp = stamp
        return keys

    def refresh(self) -> None:
        """Re-read the file if it changed since the last read."""
        if self.path is None:
            return
        with self._lock:
            try:
                stamp = self._stat()
                if stamp == self._stamp:
                    return
                keys = self._read(stamp)
            except KeyFileError as e:
                log.error("API keys not reloaded, the previous %d stay in force: %s", len(self.keys), e)
                return
            before = {k.name for k in self.keys}
            after = {k.name for k in keys}
            self.keys = keys
            log.info("API keys reloaded from %s: %d keys (added %s, removed %s)", self.path, len(keys),
                     sorted(after - before) or "none", sorted(before - after) or "none")

    def identify(self, presented: str) -> ApiKey | None:
        self.refresh()
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for k in self.keys:     # every key compared: the time does not say which matched
            if hmac.compare_digest(k.digest, digest):
                found = k
        return found


def append_key(path: Path, name: str, key: str, limits: dict[str, int] | None = None) -> None:
    """Add a key's line to `path`, in place: a file bind-mounted into a
    container keeps its inode, so the container sees the change. Created mode
    0644: it holds hashes only, and a container's service user must read it."""
    existing = path.read_text() if path.exists() else ""
    if any(k.name == name for k in parse(existing, str(path))):
        raise KeyFileError(f"{path}: a key named {name!r} exists already (revoke it first)")
    line = " ".join([name, hash_key(key), *(f"{k}={v}" for k, v in (limits or {}).items())])
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    with os.fdopen(fd, "a") as f:
        f.write(("" if not existing or existing.endswith("\n") else "\n") + line + "\n")


def remove_key(path: Path, name: str) -> bool:
    """Drop `name`'s line from `path` (rewritten in place, as append_key)."""
    lines = path.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if ln.split("#", 1)[0].split()[:1] != [name]]
    if len(kept) == len(lines):
        return False
    with open(path, "r+") as f:
        f.write("".join(kept))
        f.truncate()
    return True
