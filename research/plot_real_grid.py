"""Our policies and kvpress's presses on the same real-text prompts, every
length and compression: one markdown table (accuracy), one of KV memory, and
a plot (accuracy and peak KV against compression, a panel per length).

    .venv/bin/python research/plot_real_grid.py --ours runs/grid_ours_1024_2048,runs/grid_ours_4096 \
        --kvpress runs/grid_kvp_1024_2048,runs/grid_kvp_4096 --out docs/img/eval_real_grid.png

--ours: `kvpop eval --suite real` output folders (results.json); --kvpress:
`scripts/compare_kvpress.sh` output folders (kvpress.json). Both must have run
the same lengths, seed and families (the script checks the prompt counts).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def ours(folders: list[str]) -> dict:
    """(policy, compression, length) -> {accuracy, n, held, peak} over every family."""
    cells = {}
    for folder in folders:
        for r in json.loads((Path(folder) / "results.json").read_text()):
            if r["task"] == "all" and r.get("length") is not None:
                cells[r["policy"], r["compression"], r["length"]] = {
                    "accuracy": r["accuracy"], "n": r["n"], "held": r.get("held_tokens"), "peak": r.get("peak_kv_mib")}
    return cells


def kvpress(folders: list[str], lengths: list[int]) -> dict:
    groups = defaultdict(list)
    for folder in folders:
        for r in json.loads((Path(folder) / "kvpress.json").read_text())["rows"]:
            # Older files lack the length asked for: the prompt is within 2% of it.
            asked = r.get("asked_length") or min(lengths, key=lambda x: abs(x - r["length"]))
            groups[r["policy"], r["compression"], asked].append(r)
    return {k: {"accuracy": sum(r["correct"] for r in rs) / len(rs), "n": len(rs),
                "held": sum(r["held_tokens"] for r in rs) / len(rs),
                "peak": (sum(r["peak_kv_mib"] for r in rs) / len(rs)) if "peak_kv_mib" in rs[0] else None}
            for k, rs in groups.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ours", required=True)
    p.add_argument("--kvpress", required=True)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    a = ours(args.ours.split(","))
    lengths = sorted({k[2] for k in a})
    cells = a | kvpress(args.kvpress.split(","), lengths)
    for (pol, comp, length), c in cells.items():
        want = a.get(("dense", 0.0, length), {}).get("n")
        if want is not None and c["n"] != want:
            raise SystemExit(f"{pol} at {comp} and {length} tokens has {c['n']} prompts, dense {want}: "
                             "not the same test set")
    comps = sorted({k[1] for k in cells if k[1] > 0})
    policies = sorted({k[0] for k in cells if k[0] not in ("dense", "kvpress:dense")},
                      key=lambda s: (s.startswith("kvpress"), s))

    head = "| ranking | " + " | ".join(f"{x:,} @ {c:.2%}".replace(".00%", "%") for x in lengths for c in comps) + " |"
    lines = [head, "|---|" + "---:|" * (len(lengths) * len(comps))]
    for pol in ["dense", "kvpress:dense"] + policies:
        row = []
        for x in lengths:
            for c in comps:
                cell = cells.get((pol, 0.0 if "dense" in pol else c, x))
                row.append("-" if cell is None else f"{cell['accuracy']:.2f}")
        lines.append(f"| {pol} | " + " | ".join(row) + " |")
    n = {x: a[("dense", 0.0, x)]["n"] for x in lengths if ("dense", 0.0, x) in a}
    print("Accuracy (needle and multikey pooled; prompts per length: "
          + ", ".join(f"{x:,}: {k}" for x, k in n.items()) + ")\n")
    print("\n".join(lines))

    at = 0.875 if 0.875 in comps else comps[-1]
    print(f"\nKV at {at:.2%}: tokens a (layer, kv-head) row holds at the end / peak KV of a request in MiB "
          "(means over the prompts)\n")
    print("| ranking | " + " | ".join(f"{x:,} tokens" for x in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for pol in ["dense", "kvpress:dense"] + policies:
        row = []
        for x in lengths:
            cell = cells.get((pol, 0.0 if "dense" in pol else at, x))
            row.append("-" if cell is None or cell["held"] is None else
                       f"{cell['held']:,.0f} / {cell['peak']:.1f}" if cell["peak"] is not None else f"{cell['held']:,.0f} / -")
        print(f"| {pol} | " + " | ".join(row) + " |")

    fig, axes = plt.subplots(2, len(lengths), figsize=(4.2 * len(lengths), 7.8), sharey="row", squeeze=False)
    cmap = plt.get_cmap("tab10")
    colors = {}
    for pol in policies:
        base = pol.removeprefix("kvpress:").removesuffix("+after")
        colors.setdefault(base, cmap(len(colors) % 10))
    for j, x in enumerate(lengths):
        top, bottom = axes[0][j], axes[1][j]
        for pol in policies:
            pts = [(c, cells[pol, c, x]) for c in comps if (pol, c, x) in cells]
            if not pts:
                continue
            base = pol.removeprefix("kvpress:").removesuffix("+after")
            style = dict(color="black" if base == "oracle" else colors[base], ms=4,
                         ls=":" if pol.endswith("+after") else "--" if pol.startswith("kvpress") else "-",
                         marker="s" if pol.startswith("kvpress") else "o",
                         lw=3 if base == "learned" else 1.2, zorder=3 if base == "learned" else 2)
            if base == "oracle":      # under learned where they agree: thin, dashed, in front
                style.update(ls=(0, (2, 2)), marker="", lw=1.2, zorder=4)
            top.plot([c for c, _ in pts], [v["accuracy"] for _, v in pts], label=pol, **style)
            if all(v["peak"] is not None for _, v in pts):
                bottom.plot([c for c, _ in pts], [v["peak"] for _, v in pts], label=pol, **style)
        d = cells.get(("dense", 0.0, x))
        if d:
            top.axhline(d["accuracy"], color="grey", lw=4, alpha=0.35, label="dense")
            if d["peak"] is not None:
                bottom.axhline(d["peak"], color="grey", lw=4, alpha=0.35, label="dense")
        top.set_title(f"{x:,} tokens ({d['n'] if d else '?'} prompts)")
        top.set_ylim(-0.03, 1.03)
        bottom.set_xlabel("compression")
        for ax in (top, bottom):
            ax.set_xticks(comps, [f"{100 * c:g}%" for c in comps], fontsize=8)
    axes[0][0].set_ylabel("accuracy (needle + multikey)")
    axes[1][0].set_ylabel("peak KV of a request (MiB)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=6)
    fig.suptitle("SmolLM2-135M-Instruct: our policies (solid; dotted = budget after the prompt) "
                 "and kvpress presses (dashed) on the same prompts", fontsize=9)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=95)
    plt.close(fig)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
