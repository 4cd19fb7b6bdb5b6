"""The word-level vocabulary shared by every task family: one token per
register name, per number, per key, per symbol, so that each look-up the
model does is a single attention step over single tokens."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIALS = [PAD, BOS, EOS]
NUMBERS = [str(i) for i in range(100)]
REGISTERS = list("abcdefghijklmnop")
KEYS = [f"K{i:03d}" for i in range(128)]
LABELS = [f"x{i}" for i in range(1, 17)]
FILLER = ("the grass is green sky blue sun warm river runs past old town where people walk and "
          "talk about day night wind rain snow hill tree bird sings").split()
SYMBOLS = ["=", ":=", ";", "?", ".", "key", "recall", "regs", "sum", "ans", "pass"]

WORDS = SPECIALS + NUMBERS + REGISTERS + KEYS + LABELS + FILLER + SYMBOLS
assert len(set(WORDS)) == len(WORDS), "vocabulary words must be unique"
VOCAB = {w: i for i, w in enumerate(WORDS)}
PAD_ID, BOS_ID, EOS_ID = VOCAB[PAD], VOCAB[BOS], VOCAB[EOS]


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # HF-style: encode() prepends <s>, as Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    tok.add_special_tokens(SPECIALS)
    return tok


def encode_words(words: list[str]) -> list[int]:
    """Token ids without <s> (generators work on word lists; no tokenizer round trip)."""
    return [VOCAB[w] for w in words]


def decode_ids(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids if 0 <= i < len(WORDS) and WORDS[i] not in SPECIALS)


def save_tokenizer(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path.mkdir(parents=True, exist_ok=True)
        path = path / "tokenizer.json"
    build_tokenizer().save(str(path))
    return path


if __name__ == "__main__":
    import sys
    print(save_tokenizer(sys.argv[1] if len(sys.argv) > 1 else "tokenizer.json"))
