"""`kvpop eval --suite chat` and `kvpop bench chat` as real processes against
a real stack (`kvpop up`'s code: redis, cache-manager, compute, gateway) on
the embedded placeholder model given a chat template, at tiny size:

- the chat eval through the gateway and in process gives the same outcomes
  line for line (text, KV held, KV peak), per gap in turns;
- the chat bench: the session's turns prefill only their new message and
  hold the same KV (its usage, and compute's pool gauge) from the turn the
  budget is reached, while the stateless client's prompt and KV grow every
  turn; a JSON and a PNG come out."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpop.stack.up import start_stack
from kvpop.stack.down import stop_stack
from kvpop.runtime.paths import REPO_ROOT as REPO
from .test_chat_sessions import chat_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat_stack(tmp_path_factory):
    model = chat_model(tmp_path_factory.mktemp("chat-model"))
    st = start_stack(tmp_path_factory.mktemp("chat-stack"), model=str(model), timeout=120, supervise=False,
                     env={"KVPOP_GRACE_S": "2"}, service_args={"compute": ["--device", "cpu"]})
    yield st, model
    stop_stack(st, grace=10)


def kvpop(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpop.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_chat_eval_served_equals_in_process(chat_stack, tmp_path):
    st, model = chat_stack
    common = ["eval", "--suite", "chat", "--quick", "--gaps", "1,3", "--model", str(model),
              "--policies", "dense,h2o,snapkv", "--compression", "0.875"]
    served = kvpop(*common, "--via", st.gateway, "--out", str(tmp_path / "served"))
    assert served.returncode == 0, served.stdout[-2000:] + served.stderr[-2000:]
    here = kvpop(*common, "--no-kl", "--threads", "1", "--out", str(tmp_path / "here"))
    assert here.returncode == 0, here.stdout[-2000:] + here.stderr[-2000:]
    lines = {d: [json.loads(x) for x in (tmp_path / d / "outcomes.jsonl").read_text().splitlines()]
             for d in ("served", "here")}
    # 3 families x 2 gaps, dense and two policies at 87.5%.
    assert len(lines["served"]) == len(lines["here"]) == 3 * 2 * 3
    assert {x["length"] for x in lines["served"]} == {1, 3}
    key = ("policy", "compression", "family", "seed", "length")
    here_by = {tuple(x[k] for k in key): x for x in lines["here"]}
    for x in lines["served"]:
        assert not x.get("error"), x
        y = here_by[tuple(x[k] for k in key)]
        assert (x["text"], x["held_tokens"], x["peak_kv_mib"]) == (y["text"], y["held_tokens"], y["peak_kv_mib"])
        if x["policy"] != "dense":
            assert x["budget"] < x["prompt_tokens"] / 4, x
    # The longer gap's conversations are longer; the table has a column per gap, in turns.
    by_gap = {g: [x["prompt_tokens"] for x in lines["here"] if x["length"] == g] for g in (1, 3)}
    assert min(by_gap[3]) > max(by_gap[1]) or sum(by_gap[3]) > sum(by_gap[1])
    md = (tmp_path / "served" / "results.md").read_text()
    assert "| 1 turns | 3 turns |" in md and "| pet | number | place |" in md


def test_chat_bench_session_flat_stateless_growing(chat_stack, tmp_path):
    st, _ = chat_stack
    out, png = tmp_path / "chat.json", tmp_path / "chat.png"
    proc = kvpop("bench", "chat", "--via", st.gateway, "--metrics", st.metrics["compute"], "--turns", "6",
                 "--budget", "24", "--policy", "h2o", "--max-tokens", "4", "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    session, stateless = r["session"], r["stateless"]
    assert len(session) == len(stateless) == 6
    assert [t["session_resumed"] for t in session] == [False] + [True] * 5
    assert all(t["reprefilled_tokens"] == 0 for t in session)
    # The session prefills its new turn only; the stateless client the whole chat, more each turn.
    assert session[0]["prompt_tokens"] == stateless[0]["prompt_tokens"]
    grows = [t["prompt_tokens"] for t in stateless]
    assert all(b > a for a, b in zip(grows, grows[1:])), grows
    assert all(s["prompt_tokens"] < d["prompt_tokens"] for s, d in zip(session[1:], stateless[1:]))
    peaks = [t["kv_blocks_peak"] for t in stateless]
    assert all(b > a for a, b in zip(peaks, peaks[1:])), peaks
    # From the turn the budget is reached on, the session holds the same KV: its usage and the pool's gauge.
    start = r["summary"]["budget_reached_at_turn"]
    assert start is not None and start < 6
    held = {t["kv_blocks_resident"] for t in session[start - 1:]}
    pool = {t["pool_pages_used"] for t in session[start - 1:]}
    assert len(held) == 1 and len(pool) == 1, (held, pool)
    assert session[-1]["held_tokens_per_row"] < stateless[-1]["peak_tokens_per_row"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT stateless / session" in proc.stdout
