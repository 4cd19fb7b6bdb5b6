"""Bar chart of docs/long_context_87.json (accuracies gathered from the
`kvpop eval` and `scripts/compare_kvpress.sh` runs docs/results/long-context.md
lists) -> docs/img/long_context_87.png.

    .venv/bin/python research/plot_long_context.py
"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"


def main() -> None:
    data = json.loads((DOCS / "long_context_87.json").read_text())
    rows = data["rows"]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, (name, values) in enumerate(rows.items()):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(values))]
        ax.bar(xs, values, width, label=name, color="#444444" if name == "dense" else None)
    ax.set_xticks(range(len(data["lengths"])), data["lengths"])
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy at 87.5% compression")
    ax.set_title(f"{data['title']}\n{data['note']}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = DOCS / "img" / "long_context_87.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
