"""The layers of docs/design/architecture.md, read from the code's own imports: the runtime
(kvpop's shared modules) and the kernels at the bottom, the services above
them, the tools (CLI, benchmarks, eval, training, tasks) on top. Nothing
imports what is above it, and no service imports another service."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# kvpop's runtime modules: what every service may use. The rest of kvpop is tools.
RUNTIME = {"arrays", "config", "gguf_convert", "grpc_server", "healthcheck", "metrics", "model_store", "paths",
           "pb", "prewarm", "redis_client", "registry", "security", "store", "telemetry"}
def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "kvkernels":
        return "kernels"
    if parts[0] == "services":
        return f"service:{parts[1]}" if len(parts) > 1 else "services"
    if parts[0] == "kvpop":
        return "runtime" if len(parts) == 1 or parts[1] in RUNTIME else "tools"
    return "external"


def _imports():
    for top in ("kvpop", "services", "kvkernels"):
        for path in (REPO / top).rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            if module.startswith("kvpop.pb."):
                continue        # generated stubs
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    yield module, node.module
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        yield module, alias.name


def _allowed(src: str, dst: str) -> bool:
    a, b = _layer(src), _layer(dst)
    if b == "external" or a == b:
        return True
    if a == "tools":
        return True                                   # the top floor may use everything
    if a.startswith("service:"):
        return b in ("runtime", "kernels")            # never another service, never a tool
    if a in ("runtime", "kernels"):
        return False                                  # the ground floor imports nothing of ours above it
    return False


def test_nothing_imports_a_higher_layer_or_another_service():
    bad = sorted({(src, dst) for src, dst in _imports() if not _allowed(src, dst)})
    assert not bad, "imports across layers:\n" + "\n".join(f"  {s} -> {d}" for s, d in bad)


def test_the_rule_catches_a_violation():
    assert not _allowed("services.gateway.server", "services.compute.engine")
    assert not _allowed("kvpop.metrics", "services.compute.engine")
    assert not _allowed("kvkernels.ops", "kvpop.bench")
    assert not _allowed("services.compute.engine", "kvpop.evaluation.harness")
    assert _allowed("kvpop.bench", "services.compute.engine") and _allowed("services.compute.engine", "kvpop.config")
