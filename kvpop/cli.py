"""`kvpop` command line. Each subcommand lives in its own module, imported
only when used, so `kvpop generate` does not pay for torch."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kvpop.stack.up", "start redis (if needed), cache-manager, compute and gateway"),
    "down": ("kvpop.stack.down", "stop a stack started by `kvpop up`"),
    "status": ("kvpop.stack.status", "processes, restarts and health of a stack started by `kvpop up`"),
    "restart": ("kvpop.stack.restart", "restart one service of a stack started by `kvpop up`"),
    "generate": ("kvpop.stack.generate", "stream a completion from a running gateway"),
    "chat": ("kvpop.chat", "chat with a running gateway in the terminal (one session, streamed)"),
    "keys": ("kvpop.stack.keys", "make, list and revoke the gateway's API keys"),
    "fetch-model": ("kvpop.models.fetch", "download a named model (smollm2-135m) into the model cache"),
    "bench": ("kvpop.bench.cli", "benchmarks (engine vs transformers, ...)"),
    "tasks": ("kvpop.tasks.cli", "print or dump reasoning-task instances"),
    "train-model": ("kvpop.training.train_model", "train the embedded default model"),
    "eval": ("kvpop.evaluation.cli", "eviction-quality evaluation of policies"),
    "train-estimator": ("kvpop.training.train_estimator", "train the value-estimation network"),
}


def build_parser(load: list[str]) -> argparse.ArgumentParser:
    """The `kvpop` parser, with the flags of the subcommands named in `load`
    (their modules are imported; the others' only at use)."""
    parser = argparse.ArgumentParser(prog="kvpop", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in load:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.epilog = getattr(mod, "EPILOG", None)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Only the chosen subcommand's module is imported.
    chosen = [argv[0]] if argv and argv[0] in SUBCOMMANDS else []
    args = build_parser(chosen).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
