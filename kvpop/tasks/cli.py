"""`kvpop tasks`: print generated task instances (text, or JSON lines)."""
from __future__ import annotations

import argparse
import json

from kvpop.tasks.suite import FAMILIES, TEST_SEEDS, generate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", default="all", help=f"one of {', '.join(FAMILIES)} or 'all'")
    p.add_argument("--n", type=int, default=1, help="instances per family")
    p.add_argument("--seed", type=int, default=TEST_SEEDS.start, help="first seed")
    p.add_argument("--length", type=int, default=512, help="target prompt length in tokens")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--save-tokenizer", metavar="PATH", help="also write the task vocabulary's tokenizer.json")


def run(args) -> int:
    fams = list(FAMILIES) if args.family == "all" else [args.family]
    if any(f not in FAMILIES for f in fams):
        print(f"unknown family {args.family!r}; choose from {', '.join(FAMILIES)} or 'all'")
        return 2
    if args.n < 0 or args.length < 1:
        print("--n must be >= 0 and --length >= 1")
        return 2
    if args.save_tokenizer:
        from kvpop.tasks.vocab import save_tokenizer
        print(f"# tokenizer: {save_tokenizer(args.save_tokenizer)}")
    for fam in fams:
        for i in range(args.n):
            inst = generate(fam, args.seed + i, args.length)
            if args.json:
                print(json.dumps(inst.to_dict()))
            else:
                print(f"## {fam} seed={inst.seed} prompt_tokens={len(inst.prompt_ids)} depends={inst.depends}")
                print(f"prompt:   {inst.prompt}")
                print(f"solution: {inst.solution}")
                print(f"answer:   {inst.answer}\n")
    return 0
