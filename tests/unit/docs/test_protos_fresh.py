"""The committed stubs in kvpop/runtime/pb/ are exactly what protos/ generates."""
from __future__ import annotations

import re
import tomllib

from kvpop import protogen
# The generator stamps its own release into the stubs. A new grpcio-tools on the
# registry changes the stamp, not what the protos define, so the comparison masks
# it; the floors test below keeps the stamp honest instead.
_GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", re.M)
_PB_STAMP = re.compile(r"^# Protobuf Python Version: ([\d.]+)$", re.M)
_PB_CHECK = re.compile(r"(ValidateProtobufRuntimeVersion\(\n\s+_runtime_version\.Domain\.PUBLIC,\n)\s+(\d+),\n\s+(\d+),\n\s+(\d+),\n")


def _unstamped(text: str) -> str:
    text = _GRPC_STAMP.sub("GRPC_GENERATED_VERSION = '*'", text)
    text = _PB_STAMP.sub("# Protobuf Python Version: *", text)
    return _PB_CHECK.sub(r"\1*\n", text)


def _committed() -> dict[str, str]:
    return {p.name: p.read_text() for p in protogen.PB_DIR.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")}


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def test_committed_stubs_match_protos(tmp_path):
    fresh = {p.name: p.read_text() for p in protogen.generate(tmp_path)}
    committed = _committed()
    assert set(fresh) == set(committed), "stale kvpop/runtime/pb: run `python -m kvpop.protogen`"
    stale = sorted(name for name in fresh if _unstamped(fresh[name]) != _unstamped(committed[name]))
    assert not stale, f"stale stubs {stale}: run `python -m kvpop.protogen`"


def test_unstamping_masks_only_the_versions():
    grpc_stub = _committed()["compute_pb2_grpc.py"]
    assert _GRPC_STAMP.search(grpc_stub)
    bumped = _GRPC_STAMP.sub("GRPC_GENERATED_VERSION = '9.99.9'", grpc_stub)
    assert _unstamped(bumped) == _unstamped(grpc_stub)
    # A changed RPC is still caught.
    assert _unstamped(grpc_stub.replace("Generate", "Generat3")) != _unstamped(grpc_stub)
    pb = _committed()["compute_pb2.py"]
    assert _PB_CHECK.search(pb) and _PB_STAMP.search(pb)
    assert _unstamped(pb.replace("compute.proto", "other.proto")) != _unstamped(pb)


def test_dependency_floors_admit_no_runtime_the_stubs_refuse():
    deps = tomllib.loads((protogen.REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = dict(m.groups() for d in deps if (m := re.fullmatch(r"([\w-]+)>=([\d.]+)", d)))
    committed = _committed()
    grpc_needs = {_version(m) for t in committed.values() for m in _GRPC_STAMP.findall(t)}
    pb_needs = {tuple(int(x) for x in m.groups()[1:]) for t in committed.values() for m in _PB_CHECK.finditer(t)}
    assert grpc_needs and pb_needs
    assert _version(floors["grpcio"]) >= max(grpc_needs), "raise pyproject's grpcio floor to the stubs' stamp"
    assert _version(floors["grpcio-tools"]) >= max(grpc_needs)
    assert _version(floors["protobuf"]) >= max(pb_needs), "raise pyproject's protobuf floor to the stubs' stamp"


def test_stubs_import_package_relative():
    # Importing through the package only works when imports were rewritten.
    from kvpop.runtime.pb import cache_manager_pb2_grpc, compute_pb2, generate_pb2_grpc  # noqa: F401

    req = compute_pb2.ComputeRequest(prompt="x")
    req.eviction.budget_fraction = 0.25
    assert req.eviction.WhichOneof("budget") == "budget_fraction"
