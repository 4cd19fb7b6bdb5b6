"""Helpers shared by test files: the repository root, free ports, and a real
redis-server child process. Test files import these from here, never from a
conftest (several conftest modules share that name)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    from kvpop.stack.up import free_port as launcher_free_port   # one memory of ports handed out
    return launcher_free_port()


class RedisServer:
    """A redis-server child process; restart() keeps the port and the data dir."""

    def __init__(self, port: int | None = None, persist: bool = True):
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvpop-redis-")
        self.persist = persist
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found: run scripts/setup.sh")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", "", "--logfile", os.path.join(self.dir, "redis.log")]
        # appendonly so a restart keeps sessions, like the compose deployment.
        args += ["--appendonly", "yes" if self.persist else "no", "--appendfsync", "everysec"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final fsync, what a crash or the OOM killer does."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def stop_processes(procs, timeout: float = 20) -> None:
    """SIGTERM every process still running (all at once, so their graceful
    shutdowns overlap), then wait for each; SIGKILL one that outlasts ``timeout``."""
    procs = [p for p in procs if p is not None]
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_until(cond, timeout: float, what: str, interval: float = 0.05):
    """Poll ``cond`` until it returns something truthy (returned) or fail
    after ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def collect(stream):
    """(token ids, text, Finished or None) of a public Generate stream."""
    ids, text, final = [], [], None
    for r in stream:
        if r.HasField("chunk"):
            assert final is None, "chunk after the final message"
            ids.extend(r.chunk.token_ids)
            text.append(r.chunk.text)
        else:
            final = r.finished
    return ids, "".join(text), final
