"""The committed stubs in kvpop/pb/ are exactly what protos/ generates."""
from __future__ import annotations

from kvpop import protogen


def test_committed_stubs_match_protos(tmp_path):
    fresh = {p.name: p.read_text() for p in protogen.generate(tmp_path)}
    committed = {p.name: p.read_text() for p in protogen.PB_DIR.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")}
    assert set(fresh) == set(committed), "stale kvpop/pb: run `python -m kvpop.protogen`"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not stale, f"stale stubs {stale}: run `python -m kvpop.protogen`"


def test_stubs_import_package_relative():
    # Importing through the package only works when imports were rewritten.
    from kvpop.pb import cache_manager_pb2_grpc, compute_pb2, generate_pb2_grpc  # noqa: F401

    req = compute_pb2.ComputeRequest(prompt="x")
    req.eviction.budget_fraction = 0.25
    assert req.eviction.WhichOneof("budget") == "budget_fraction"
