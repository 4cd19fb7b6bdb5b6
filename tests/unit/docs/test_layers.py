"""The layers of docs/design/architecture.md, read from the code's own imports
and its folders (no list of modules): kvpop/runtime/ and the kernels at the
bottom, the services above them, the tools (the rest of kvpop: CLI, stack,
benchmarks, models, eval, training, tasks) on top. Nothing imports what is
above it, no service imports another service, and no import cycles."""
from __future__ import annotations

import ast

from helpers.common import REPO


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "kvkernels":
        return "kernels"
    if parts[0] == "services":
        return f"service:{parts[1]}" if len(parts) > 1 else "services"
    if parts[0] == "kvpop":
        return "runtime" if len(parts) > 1 and parts[1] == "runtime" else "tools"
    return "external"


def _imports():
    for top in ("kvpop", "services", "kvkernels"):
        for path in (REPO / top).rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            if module.startswith("kvpop.runtime.pb."):
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
    assert not _allowed("services.gateway.server", "services.compute.engine.engine")
    assert not _allowed("kvpop.runtime.metrics", "services.compute.engine.engine")
    assert not _allowed("kvpop.runtime.config", "kvpop.models.fetch")          # the runtime never uses a tool
    assert not _allowed("kvkernels.ops", "kvpop.bench.cli")
    assert not _allowed("services.compute.engine.engine", "kvpop.evaluation.harness")
    assert not _allowed("services.compute.server", "kvpop.stack.up")           # nor does a service
    assert _allowed("kvpop.bench.cli", "services.compute.engine.engine") and _allowed("services.compute.engine.engine",
                                                                               "kvpop.runtime.config")


def test_the_runtime_folder_holds_what_services_import():
    """Every kvpop module a service imports is in kvpop/runtime/ (the folder says what the services stand on)."""
    used = {dst for src, dst in _imports() if _layer(src).startswith("service") and dst.startswith("kvpop")}
    assert used and all(_layer(d) == "runtime" for d in used), sorted(d for d in used if _layer(d) != "runtime")


def _modules() -> set[str]:
    out = set()
    for top in ("kvpop", "services", "kvkernels"):
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _module_graph() -> dict[str, set[str]]:
    """Module -> our modules it imports (`from pkg import mod` imports pkg and pkg.mod)."""
    known, graph = _modules(), {}
    for top in ("kvpop", "services", "kvkernels"):
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            src = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if src.startswith("kvpop.runtime.pb."):
                continue
            deps = graph.setdefault(src, set())
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    deps.add(node.module)             # runs the package's __init__ too
                    deps.update(f"{node.module}.{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(alias.name for alias in node.names)
            deps &= known
            deps.discard(src)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert not _cycles(_module_graph()), "import cycles:\n" + "\n".join(map(str, _cycles(_module_graph())))


def test_the_cycle_check_catches_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles({"a": {"b"}, "b": set()})
