"""Tokenizer: a thin wrapper over a `tokenizers` tokenizer.json, plus an
incremental decoder that streams text without splitting multi-token characters."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

_EOS_NAMES = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>")
_BOS_NAMES = ("<s>", "<|begin_of_text|>")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json" if model_dir.is_dir() else model_dir
        if not path.is_file():
            raise ValueError(f"tokenizer.json not found: {path}")
        folder = path.parent
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"cannot read {path}: {e}") from e
        # Text a client sends is text: "<s>" in a prompt must not become the
        # BOS token (nor any other control token); BOS is added by id.
        self._tok.encode_special_tokens = True
        config = _read_json(folder / "config.json")
        gen = _read_json(folder / "generation_config.json")
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = set(_ids(config.get("eos_token_id"))) | set(_ids(gen.get("eos_token_id")))
        if not eos:
            eos = {vocab[n] for n in _EOS_NAMES if n in vocab}
        self.eos_token_ids: set[int] = eos
        bos = config.get("bos_token_id", gen.get("bos_token_id"))
        if bos is None:
            bos = next((vocab[n] for n in _BOS_NAMES if n in vocab), None)
        self.bos_token_id: int | None = None if bos is None else int(bos)
        # Some families (Qwen2) define a bos id but never prepend it.
        self.add_bos_default = bool(tok_cfg.get("add_bos_token", True)) and self.bos_token_id is not None
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids: set[int] = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos_default:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def incremental_decoder(self, prompt_ids: list[int] | None = None) -> "IncrementalDecoder":
        return IncrementalDecoder(self, prompt_ids)


class IncrementalDecoder:
    """push(token_id) -> the text it completes ("" while a character is still
    partial). Decodes a short window, not the whole output, per token, and keeps
    a few tokens of left context so decoders that strip a leading space
    (SentencePiece) still emit it (the vLLM/TGI prefix/read offset scheme)."""

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids or [])[-self.CONTEXT:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.ids[self.prefix_offset:])
        # U+FFFD at the end means the last token ended inside a UTF-8 sequence: wait for the rest.
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._trim()
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still pending (an incomplete character decodes as U+FFFD)."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]

    def _trim(self) -> None:
        # Drop ids before the window so memory stays constant over long outputs.
        if self.prefix_offset > 64:
            cut = self.prefix_offset
            self.ids = self.ids[cut:]
            self.prefix_offset -= cut
            self.read_offset -= cut
