"""Accuracy against peak KV memory, one point per policy label: where a
prefill allowance (`learned+prefill<N>x`) lands between the budget held
during prefill and the budget after the prompt.

    .venv/bin/python research/plot_allowance.py --runs runs/allow8k --compression 0.875 \
        --point "learned=67.2:0.50" --point "learned+after=356.9:0.60" \
        --title "SmolLM2, 8k, 87.5%" --out docs/img/allowance_8k.png

--runs: `kvpop eval` output folders (their results.json, every length pooled);
--point LABEL=MIB:ACCURACY adds a cell measured elsewhere on the same prompts.
Prints the markdown table it plotted.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def cells(runs: list[Path], compression: float) -> dict[str, tuple[float, float, int]]:
    """label -> (peak KV MiB, accuracy, n) at ``compression`` (dense at any)."""
    out = {}
    for run in runs:
        for r in json.loads((run / "results.json").read_text()):
            if r["task"] != "all" or r.get("length") is not None or r.get("peak_kv_mib") is None:
                continue
            if r["policy"] == "dense" or abs(r["compression"] - compression) < 1e-9:
                out[r["policy"]] = (r["peak_kv_mib"], r["accuracy"], r["n"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="comma-separated kvpop eval output folders")
    p.add_argument("--compression", type=float, default=0.875)
    p.add_argument("--point", action="append", default=[], metavar="LABEL=MIB:ACCURACY")
    p.add_argument("--title", default="")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    found = cells([Path(r) for r in args.runs.split(",") if r.strip()], args.compression)
    for spec in args.point:
        label, _, rest = spec.partition("=")
        mib, _, acc = rest.partition(":")
        found[label] = (float(mib), float(acc), 0)
    order = sorted(found, key=lambda k: found[k][0])
    print("| policy | peak KV (MiB) | accuracy | n |")
    print("|---|---:|---:|---:|")
    for k in order:
        mib, acc, n = found[k]
        print(f"| {k} | {mib:,.1f} | {acc:.2f} | {n or 'earlier run'} |")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    learned = [k for k in order if k.startswith("learned")]
    ax.plot([found[k][0] for k in learned], [found[k][1] for k in learned], "-o", color="tab:blue", label="learned")
    names = {"learned": "1x (default)", "learned+after": "after prompt"}
    for i, k in enumerate(learned):
        ax.annotate(names.get(k, k.removeprefix("learned+prefill")), (found[k][0], found[k][1]),
                    textcoords="offset points", xytext=(-8, 8 if i % 2 else -13), fontsize=7)
    if "dense" in found:
        ax.axhline(found["dense"][1], color="grey", lw=3, alpha=0.4, label="dense accuracy")
        ax.axvline(found["dense"][0], color="grey", lw=1, ls="--", alpha=0.6, label="dense peak")
    ax.set_xlabel("peak KV per request (MiB)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(args.title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
