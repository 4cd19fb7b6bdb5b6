"""Flags that several `kvpop` commands share, under one name each.

`--budget` is the KV budget everywhere; the older spellings still parse, with a
one-line warning on stderr, so scripts written against them keep running."""
from __future__ import annotations

import argparse
import sys

BUDGET = "--budget"
DEPRECATED_BUDGET = ("--kv-budget", "--budget-tokens")


class DeprecatedAlias(argparse.Action):
    """Stores like the flag it stands for and says which name to use instead."""

    def __init__(self, option_strings, dest, *, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_budget(p: argparse.ArgumentParser, *, help: str, **kwargs) -> None:
    """`--budget` (dest `budget`), and the deprecated names as hidden aliases."""
    p.add_argument(BUDGET, dest="budget", help=help, **kwargs)
    alias = {k: v for k, v in kwargs.items() if k in ("type", "metavar")}
    for old in DEPRECATED_BUDGET:
        p.add_argument(old, dest="budget", action=DeprecatedAlias, new=BUDGET, help=argparse.SUPPRESS, **alias)
