"""Test certificates made with the openssl CLI: a CA, leaves signed by it
(SAN 127.0.0.1 and localhost, server and client use), and a rogue CA."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def make_leaf(d: Path, name: str, ca: str) -> None:
    (d / f"{name}.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
             "-extfile", f"{name}.ext", cwd=d)


def make_pki(d: Path, leaves=("server", "client")) -> Path:
    """ca + the given leaves + rogue-ca + rogue (signed by rogue-ca) in d."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl CLI is needed to make test certificates")
    make_ca(d, "ca")
    for leaf in leaves:
        make_leaf(d, leaf, "ca")
    make_ca(d, "rogue-ca")
    make_leaf(d, "rogue", "rogue-ca")
    return d
