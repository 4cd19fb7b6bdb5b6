"""Documentation prose: the docstrings of the standard library's modules,
classes and functions, as sentences (a training source)."""
from __future__ import annotations

import ast

from kvpop.tasks.sources import stdlib_files
from kvpop.tasks.sources.corpus import sentences

SEP = " "


def units() -> list[str]:
    out = []
    for path in stdlib_files.files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    # Prose only: indented blocks (examples, tables) read as code, not sentences.
                    out += sentences("\n".join(ln for ln in doc.splitlines() if not ln.startswith((" ", ">>>"))))
    return out
