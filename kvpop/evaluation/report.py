"""results.json records, the markdown table and accuracy.png."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def records(outcomes, families: list[str]) -> list[dict]:
    """One row per (policy, compression, task, length): task is a family or
    'all'; length is None (every length pooled) or, for suites whose instances
    carry the length asked for, each such length."""
    groups = defaultdict(list)
    for o in outcomes:
        key = (o.setting.policy, o.setting.compression)
        lengths = [None] + ([o.instance.length] if getattr(o.instance, "length", 0) else [])
        for length in lengths:
            groups[key + (o.instance.family, length)].append(o)
            groups[key + ("all", length)].append(o)
    dense_acc = {}
    rows = []
    for (policy, comp, task, length), os_ in groups.items():
        kls = [k for o in os_ for k in o.kl]
        budgets = [o.budget for o in os_ if o.budget is not None]
        total = [len(o.instance.prompt_ids) + len(o.instance.solution_ids) for o in os_]
        rows.append({
            "policy": policy, "compression": comp, "task": task, "length": length, "n": len(os_),
            "accuracy": sum(o.correct for o in os_) / len(os_),
            # None: not measured (no teacher-forced pass); dense against itself is 0.
            "kl": (sum(kls) / len(kls)) if kls else (0.0 if policy == "dense" else None),
            "mean_generated_tokens": sum(o.generated for o in os_) / len(os_),
            "kv_kept": (sum(b / t for b, t in zip(budgets, total)) / len(budgets)) if budgets else 1.0,
            # Measured by compute (usage): tokens per (layer, kv-head) row at the end, and the
            # request's peak KV in MiB (prefill included); means over the cell's prompts.
            "held_tokens": _mean([o.held_tokens for o in os_]),
            "peak_kv_mib": _mean([o.peak_bytes / 2 ** 20 for o in os_ if o.peak_bytes is not None]),
        })
        if policy == "dense":
            dense_acc[task, length] = rows[-1]["accuracy"]
    for r in rows:
        d = dense_acc.get((r["task"], r["length"]))
        r["retention"] = (r["accuracy"] / d) if d else None
    order = {t: i for i, t in enumerate(["all"] + families)}
    rows.sort(key=lambda r: (r["length"] is not None, r["length"] or 0, r["compression"], r["policy"] != "dense",
                             r["policy"], order.get(r["task"], 99)))
    return rows


def title(meta: dict) -> str:
    """The line above a real-text table: whose text the haystack is, and
    whether any network here was trained on it."""
    if "source" not in meta:
        return ""
    from kvpop.tasks.sources import catalog as sources
    return f"Haystack text: {sources.label(meta['source'])}\n\n"


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _sig(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def markdown(rows: list[dict], families: list[str], unit: str = "tokens") -> str:
    """unit: what an instance's length counts (prompt tokens; turns of talk in the chat suite)."""
    pooled = [r for r in rows if r.get("length") is None]
    by = {(r["policy"], r["compression"], r["task"]): r for r in pooled}
    settings = sorted({(r["compression"], r["policy"]) for r in pooled}, key=lambda s: (s[0], s[1] != "dense", s[1]))
    head = ["policy", "compression", *families, "all", "retention", "KL", "gen. tokens", "KV held (tokens/row)",
            "peak KV (MiB)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for comp, pol in settings:
        a = by[(pol, comp, "all")]
        cells = [pol, f"{comp:.2%}" if comp else "0 (dense)"]
        cells += [f"{by[(pol, comp, f)]['accuracy']:.2f}" if (pol, comp, f) in by else "-" for f in families]
        ret = a["retention"]
        cells += [f"**{a['accuracy']:.3f}**", "-" if ret is None else f"{ret:.3f}", "-" if a["kl"] is None else f"{a['kl']:.4f}",
                  f"{a['mean_generated_tokens']:.1f}", _sig(a.get("held_tokens")), _sig(a.get("peak_kv_mib"))]
        out.append("| " + " | ".join(cells) + " |")
    lengths = sorted({r["length"] for r in rows if r.get("length") is not None})
    if len(lengths) > 1:
        # The pooled table hides where accuracy falls off: one column per length asked for.
        per = {(r["policy"], r["compression"], r["length"]): r for r in rows
               if r.get("length") is not None and r["task"] == "all"}
        title = "prompt length" if unit == "tokens" else unit
        out += ["", f"By {title} (every family pooled; accuracy, n per cell in brackets):", "",
                "| policy | compression | " + " | ".join(f"{x:,} {unit}" for x in lengths) + " |",
                "|" + "---|" * (2 + len(lengths))]
        for comp, pol in settings:
            cells = [pol, f"{comp:.2%}" if comp else "0 (dense)"]
            cells += [f"{per[pol, comp, x]['accuracy']:.3f} ({per[pol, comp, x]['n']})" if (pol, comp, x) in per
                      else "-" for x in lengths]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], families: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = ["all"] + families
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.4 * len(tasks), 3.6), sharey=True)
    rows = [r for r in rows if r.get("length") is None]
    policies = sorted({r["policy"] for r in rows if r["policy"] != "dense"})
    for ax, task in zip(axes, tasks):
        dense = [r for r in rows if r["policy"] == "dense" and r["task"] == task]
        for pol in policies:
            pts = sorted((r["compression"], r["accuracy"]) for r in rows if r["policy"] == pol and r["task"] == task)
            if pts:
                style = "k--" if pol == "oracle" else "-o"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=pol, ms=3)
        if dense:
            ax.axhline(dense[0]["accuracy"], color="grey", lw=3, alpha=0.4, label="dense")
        ax.set_title(task); ax.set_xlabel("compression"); ax.set_ylim(-0.02, 1.02)
    axes[0].set_ylabel("exact-match accuracy")
    axes[-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout(); fig.savefig(path, dpi=90); plt.close(fig)


def outcome_line(o) -> dict:
    """One request of the run as it went: which prompt, what came back, whether
    it counted, the KV it held. Pooled tables hide which prompt a policy lost."""
    inst, s = o.instance, o.setting
    expected = getattr(inst, "answers", None) or [getattr(inst, "answer", "")]
    line = {"policy": s.policy, "compression": s.compression, "family": inst.family, "seed": inst.seed,
            "length": getattr(inst, "length", 0) or None, "prompt_tokens": len(inst.prompt_ids),
            "budget": o.budget, "expected": expected, "correct": o.correct, "text": o.text,
            "held_tokens": None if o.held_tokens is None else round(o.held_tokens, 1),
            "peak_kv_mib": None if o.peak_bytes is None else round(o.peak_bytes / 2**20, 2)}
    if o.error:
        line["error"] = o.error
    return line


def write(rows: list[dict], families: list[str], out: Path, meta: dict, outcomes: list | None = None) -> None:
    """results.json (the table's rows), meta.json, results.md, accuracy.png and,
    given the outcomes, outcomes.jsonl (one line per request: outcome_line)."""
    out.mkdir(parents=True, exist_ok=True)
    if outcomes is not None:
        with open(out / "outcomes.jsonl", "w") as f:
            for o in outcomes:
                f.write(json.dumps(outcome_line(o)) + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    unit = meta.get("length_unit", "tokens")
    (out / "results.md").write_text(f"<!-- {json.dumps(meta)} -->\n" + title(meta) + markdown(rows, families, unit))
    plot(rows, families, out / "accuracy.png")
