"""Where a benchmark's results go: `--json` and `--plot`, as every subcommand writes them."""
from __future__ import annotations

import json
from typing import Callable


def write(results: dict, args, plot: Callable[[dict, object], None] | None = None, indent: int = 2) -> None:
    """The results as JSON at ``args.json`` and ``plot(results, args.plot)``, each
    only where asked for; folders are made as needed."""
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=indent))
        print(f"results: {args.json}")
    if plot is not None and getattr(args, "plot", None):
        plot(results, args.plot)
        print(f"plot: {args.plot}")
