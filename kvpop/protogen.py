"""Regenerate the Python stubs in kvpop/runtime/pb/ from protos/ (`python -m kvpop.protogen`).

protoc writes `from kvpop.v1 import generate_pb2`, which would need the proto
package tree on sys.path; we flatten the output into kvpop/runtime/pb/ and rewrite those
imports to package-relative ones (the TGI workaround). tests/unit/docs/test_protos_fresh.py
regenerates into a temp dir and fails if the committed files differ.
"""
from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "protos"
PB_DIR = REPO / "kvpop" / "runtime" / "pb"

_IMPORT = re.compile(r"^from kvpop\.v1 import (\w+_pb2)", re.M)


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the flattened, import-fixed stubs into out_dir; return the files written."""
    from grpc_tools import protoc
    import grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        args += [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for f in sorted(Path(tmp).rglob("*.py*")):
            text = _IMPORT.sub(r"from . import \1", f.read_text())
            dest = out_dir / f.name
            dest.write_text(text)
            written.append(dest)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated gRPC stubs; regenerate with `python -m kvpop.protogen`."""\n')
    return [init, *written]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        for old in PB_DIR.glob("*_pb2*.py*"):
            old.unlink()
        PB_DIR.mkdir(exist_ok=True)
        for f in files:
            shutil.copy(f, PB_DIR / f.name)
    print(f"wrote {len(files)} files to {PB_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
