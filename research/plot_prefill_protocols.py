"""The prefill protocols on held-out text: accuracy against peak KV memory,
one panel per prompt length, one point per policy label (dense, the budget
held during prefill, a prefill allowance, the budget after the prompt),
pooled over the runs' text sources (each run's meta.json names its source).

    .venv/bin/python research/plot_prefill_protocols.py --runs runs/p-reference-2048,runs/p-licenses-2048,... \
        --out docs/img/prefill_protocols_held_out.png

Prints the markdown table it plotted: per source and pooled, each cell
accuracy (right / n) and mean peak KV in MiB.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

NAMES = {"dense": "dense", "learned": "learned (default)", "learned+prefill1x": "held during prefill",
         "learned+after": "after the prompt"}


def label(policy: str) -> str:
    from kvpop.evaluation.harness import after_prompt, prefill_allowance
    if policy in NAMES:
        name = NAMES[policy]
    else:
        name = f"allowance {policy.removeprefix('learned+prefill')}" if "+prefill" in policy else policy
    # The suffix that asks for what a plain label gets (kvpop/runtime/config.py DEFAULT_PREFILL).
    if policy.startswith("learned+") and (after_prompt(policy), prefill_allowance(policy)) == \
            (after_prompt("learned"), prefill_allowance("learned")):
        name += " (default)"
    return name


def cells(runs: list[Path]) -> dict[tuple[str, int, str], tuple[int, int, float]]:
    """(source, length, policy) -> (right, n, peak KV MiB) for the 'all' rows of each length."""
    out = {}
    for run in runs:
        source = json.loads((run / "meta.json").read_text()).get("source", "generator")
        for r in json.loads((run / "results.json").read_text()):
            if r["task"] == "all" and r.get("length") is not None:
                out[source, r["length"], r["policy"]] = (round(r["accuracy"] * r["n"]), r["n"], r["peak_kv_mib"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="comma-separated kvpop eval output folders")
    p.add_argument("--title", default="SmolLM2-135M-Instruct, 87.5%, held-out text")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    found = cells([Path(r) for r in args.runs.split(",") if r.strip()])
    sources = sorted({s for s, _, _ in found})
    lengths = sorted({n for _, n, _ in found})
    policies = sorted({q for _, _, q in found}, key=lambda q: (q != "dense", q != "learned", q))
    pooled = defaultdict(lambda: [0, 0, 0.0])
    for (s, n, q), (right, total, mib) in found.items():
        cell = pooled[n, q]
        cell[0] += right
        cell[1] += total
        cell[2] += mib * total
    print("| policy | " + " | ".join(f"{s} {n:,}" for n in lengths for s in sources + ["pooled"]) + " |")
    print("|---|" + "---:|" * (len(lengths) * (len(sources) + 1)))
    for q in policies:
        row = []
        for n in lengths:
            for s in sources:
                c = found.get((s, n, q))
                row.append(f"{c[0]}/{c[1]}, {c[2]:,.0f} MiB" if c else "-")
            right, total, mibn = pooled[n, q]
            row.append(f"**{right}/{total}**, {mibn / total:,.0f} MiB" if total else "-")
        print(f"| {label(q)} | " + " | ".join(row) + " |")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.6), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        for i, q in enumerate(policies):
            right, total, mibn = pooled[n, q]
            if not total:
                continue
            ax.scatter([mibn / total], [right / total], s=60, color=f"C{i}", label=label(q), zorder=3)
        here = sorted({s for s, m, _ in found if m == n})
        ax.set_title(f"{n:,} tokens ({' + '.join(here)})", fontsize=9)
        ax.set_xlabel("peak KV per request (MiB)")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (needle + multikey)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
