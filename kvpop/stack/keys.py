"""`kvpop keys`: make, list and revoke the gateway's API keys (the file
KVPOP_API_KEYS_FILE names). The file keeps only each key's hash; `new`
prints the key itself once, on stdout. A running gateway re-reads the file
at its next call: no restart."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.gateway.apikeys import LIMITS, KeyFileError, append_key, hash_key, new_key, parse, remove_key


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    new = sub.add_parser("new", help="make a key NAME, add its hash to --file, print the key")
    new.add_argument("name")
    new.add_argument("--file", type=Path, required=True, help="the key file (created if missing)")
    for limit in LIMITS:
        new.add_argument(f"--{limit.replace('_', '-')}", type=int, metavar="N",
                         help=f"this key's {limit} limit (default: the gateway's; 0 = none)")
    rev = sub.add_parser("revoke", help="remove NAME from --file")
    rev.add_argument("name")
    rev.add_argument("--file", type=Path, required=True)
    ls = sub.add_parser("list", help="names and limits in --file")
    ls.add_argument("--file", type=Path, required=True)
    sub.add_parser("hash", help="read a key on stdin, print the sha256:HEX a key line takes")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "new":
            key = new_key()
            limits = {k: getattr(args, k) for k in LIMITS if getattr(args, k) is not None}
            append_key(args.file, args.name, key, limits)
            print(f"key {args.name!r} added to {args.file}; send it as 'authorization: Bearer <key>' "
                  f"(kvpop generate --api-key, or KVPOP_API_KEY). It is shown only now:", file=sys.stderr)
            print(key)
        elif args.action == "revoke":
            if not remove_key(args.file, args.name):
                print(f"kvpop keys: no key named {args.name!r} in {args.file}", file=sys.stderr)
                return 1
            print(f"key {args.name!r} removed from {args.file}; gateways refuse it from their next call",
                  file=sys.stderr)
        elif args.action == "list":
            for k in parse(args.file.read_text(), str(args.file)):
                print(k.name, *(f"{n}={v}" for n, v in k.limits.items()))
        else:
            key = sys.stdin.readline().strip()
            if not key:
                print("kvpop keys hash: no key on stdin", file=sys.stderr)
                return 1
            print(hash_key(key))
    except (KeyFileError, OSError) as e:
        print(f"kvpop keys: {e}", file=sys.stderr)
        return 1
    return 0
