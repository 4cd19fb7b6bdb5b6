"""The embedded default model reads only its tasks' words (`kvpop tasks`):
a word-level vocabulary of 302 entries and no chat template. Free text or a
chat sent to it gets noise or an error, so `kvpop generate` says once, on
stderr, what the model is and where a text model comes from."""
from __future__ import annotations

import json
from functools import lru_cache

from kvpop.runtime.paths import DEFAULT_MODEL_DIR

NOTE = ("kvpop generate: note: the default model is a task model: it reads only the words of its "
        "tasks (`kvpop tasks --family registers --n 1`) and has no chat template{what}. For text and "
        "chats serve a text model: `kvpop fetch-model smollm2-135m`, then `kvpop down` and "
        "`kvpop up --model smollm2-135m`.")


@lru_cache(maxsize=1)
def task_vocabulary() -> frozenset[str]:
    tok = json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text())
    return frozenset(tok["model"]["vocab"])


def serves_default_model(info) -> bool:
    """`info` is the gateway's ModelInfo: the embedded model's folder name, no chat template."""
    return info.name == DEFAULT_MODEL_DIR.name and not info.chat_template


def unknown_words(prompt: str) -> list[str]:
    vocab = task_vocabulary()
    return [w for w in prompt.split() if w not in vocab]


def note_for(info, prompt: str | None, chat: bool) -> str | None:
    """The note when a request does not fit the default model; None when it does."""
    if not serves_default_model(info):
        return None
    if chat:
        return NOTE.format(what="; --chat needs one")
    unknown = unknown_words(prompt or "")
    if not unknown:
        return None
    shown = " ".join(repr(w) for w in unknown[:3]) + (" ..." if len(unknown) > 3 else "")
    return NOTE.format(what=f"; unknown to it: {shown}")
