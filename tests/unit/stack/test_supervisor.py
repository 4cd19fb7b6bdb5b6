"""The supervisor of `kvpop up` on stand-in processes (real processes, real
PIDs, no model): a SIGKILLed process is back at once, one that keeps dying
is backed off and reported as a crash loop (log, supervisor.json, `kvpop
status`), `kvpop restart` is served, and stopping the supervisor leaves the
services running."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.common import wait_until
from kvpop.stack.up import Proc, Stack, proc_start_time, request_restart
from kvpop.runtime.paths import REPO_ROOT
from kvpop.stack.supervisor import CRASH_LOOP_AFTER, MAX_DELAY_S, STATUS_FILE, restart_delay


def test_restart_delays():
    assert restart_delay(0) == 0.0
    assert [restart_delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert restart_delay(50) == MAX_DELAY_S


def _spawn(cmd: list[str], log) -> Proc:
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Proc("", p.pid, "", log.name, cmd, proc_start_time(p.pid)), p


def test_supervisor_restarts_backs_off_and_reports(tmp_path):
    (tmp_path / "logs").mkdir()
    stack = Stack(state_dir=str(tmp_path))
    children = []
    for name, cmd in (("steady", ["sleep", "300"]), ("flaky", ["sh", "-c", "echo boom-$$; exit 3"])):
        with open(tmp_path / "logs" / f"{name}.log", "ab") as log:
            proc, child = _spawn(cmd, log)
        # The flaky one's address never answers a health check: its runs are never good.
        proc.name, proc.address = name, "127.0.0.1:1" if name == "flaky" else ""
        children.append(child)
        stack.processes.append(proc)
    stack.save()
    sup_log = open(tmp_path / "logs" / "supervisor.log", "ab")
    sup = subprocess.Popen([sys.executable, "-m", "kvpop.stack.supervisor", "--state-dir", str(tmp_path)], cwd=REPO_ROOT,
                           stdout=sup_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def status():
            try:
                return json.loads((tmp_path / STATUS_FILE).read_text())["services"]
            except (OSError, ValueError, KeyError):
                return None

        wait_until(lambda: Stack.load(tmp_path).has("supervisor"), 20, "the supervisor to record itself")
        steady = Stack.load(tmp_path).proc("steady")
        os.kill(steady.pid, signal.SIGKILL)
        t0 = time.monotonic()
        new = wait_until(lambda: (p := Stack.load(tmp_path).proc("steady")).pid != steady.pid and p.alive() and p,
                         10, "steady to be restarted")
        assert time.monotonic() - t0 < 2.0
        children[0].wait(5)     # ours to reap: the supervisor cannot know how it died
        s = wait_until(lambda: (s := status()) and s["steady"]["restarts"] == 1 and s, 5, "the status file")
        assert s["steady"]["state"] == "running" and not s["steady"]["crash_loop"]
        # Killed again soon after a good (ready) run: still at once, no backoff.
        wait_until(lambda: status()["steady"]["ready"], 5, "the new steady to be ready")
        os.kill(new.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: (p := Stack.load(tmp_path).proc("steady")).pid != new.pid and p.alive(), 10,
                   "steady to be restarted again")
        assert time.monotonic() - t0 < 2.0
        s = wait_until(lambda: (s := status()) and s["steady"]["restarts"] == 2 and s, 5, "the status file")
        assert s["steady"]["quick_exits"] == 0 and s["steady"]["last_exit"] == "signal SIGKILL"

        # The flaky one dies before it is ever ready: backed off, then reported.
        s = wait_until(lambda: (s := status()) and s["flaky"]["crash_loop"] and s, 20, "the crash loop report")
        assert s["flaky"]["quick_exits"] >= CRASH_LOOP_AFTER and s["flaky"]["last_exit"] == "exit code 3"
        log_text = (tmp_path / "logs" / "supervisor.log").read_text()
        assert "flaky is crash-looping" in log_text and "boom-" in log_text, log_text
        flaky_log = (tmp_path / "logs" / "flaky.log").read_text()
        assert flaky_log.count("---- kvpop supervisor: flaky exit code 3; restart") >= CRASH_LOOP_AFTER - 1
        st = subprocess.run([sys.executable, "-m", "kvpop.cli", "status", "--state-dir", str(tmp_path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert st.returncode == 1 and "CRASH LOOP" in st.stdout and "NOT all up" in st.stdout, st.stdout + st.stderr
        # Backoff: restarts of the flaky one slow down instead of spinning.
        n = status()["flaky"]["restarts"]
        time.sleep(1.0)
        assert status()["flaky"]["restarts"] <= n + 1

        # `kvpop restart` through the control file: a new pid, not counted as a failure.
        before = Stack.load(tmp_path).proc("steady")
        request_restart(tmp_path, "steady")
        wait_until(lambda: (p := Stack.load(tmp_path).proc("steady")).pid != before.pid and p.alive(), 20,
                   "the requested restart")
        s = wait_until(lambda: (s := status()) and s["steady"]["restarts"] == 3 and s, 5, "the status file")
        assert s["steady"]["quick_exits"] == 0 and not s["steady"]["crash_loop"]
        assert s["steady"]["last_exit"] == "restart requested"
        assert not (tmp_path / "control" / "restart-steady").exists()

        # Stopping the supervisor stops nothing else.
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(10) == 0
        assert Stack.load(tmp_path).proc("steady").alive()
    finally:
        if sup.poll() is None:
            sup.kill()
        sup_log.close()
        final = Stack.load(tmp_path)
        for p in final.processes if final else []:
            if p.name != "supervisor" and p.alive():
                os.killpg(p.pid, signal.SIGKILL)
        for c in children:
            if c.poll() is None:
                c.kill()


@pytest.mark.parametrize("mode", [0o600])
def test_token_file_is_private(tmp_path, mode):
    from kvpop.runtime.security import SecurityConfig, write_token

    path = write_token(tmp_path / "state" / "internal_token", "abc123")
    assert (path.stat().st_mode & 0o777) == mode
    assert SecurityConfig.from_env({"KVPOP_INTERNAL_TOKEN_FILE": str(path)}).token == "abc123"


def test_free_port_never_hands_out_a_port_twice():
    # The kernel may return the port a just-closed probe had; a stack given the
    # same number for two listeners fails at start ("Address already in use").
    from kvpop.stack.up import free_port
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
