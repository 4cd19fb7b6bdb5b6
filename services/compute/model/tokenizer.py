"""Tokenizer: a thin wrapper over a `tokenizers` tokenizer.json, plus an
incremental decoder that streams text without splitting multi-token characters."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

_EOS_NAMES = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>")
_BOS_NAMES = ("<s>", "<|begin_of_text|>")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _token_text(value) -> str | None:
    """A tokenizer_config special-token entry: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, tok_cfg: dict) -> str | None:
    """The default chat template, where transformers looks for it:
    chat_template.jinja, chat_template.json, then tokenizer_config.json."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    value = _read_json(folder / "chat_template.json").get("chat_template", tok_cfg.get("chat_template"))
    if isinstance(value, list):     # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value.strip() else None


class Tokenizer:
    """Encodes as transformers' `AutoTokenizer` does for the same folder, with
    one deliberate difference: special-token text in a prompt is text (a
    client cannot inject BOS, EOS or a chat control token).

    Special tokens around a fresh sequence (`encode(text, add_bos=True)`)
    are what tokenizer.json's post-processor adds, nothing when it has none:
    transformers 5 reads them so and ignores tokenizer_config.json's
    `add_bos_token` / `add_eos_token` when a tokenizer.json exists. Llama 3's
    and Mistral's TemplateProcessing add their BOS; SmolLM2's and Qwen2's
    ByteLevel post-processor adds nothing.
    """

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json" if model_dir.is_dir() else model_dir
        if not path.is_file():
            raise ValueError(f"tokenizer.json not found: {path}")
        folder = path.parent
        try:
            text = path.read_text()
            self._tok = HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"cannot read {path}: {e}") from e
        self._json = text
        self._tok_control: HFTokenizer | None = None   # the same, recognising special tokens (chat templates)
        # Text a client sends is text: "<s>" in a prompt must not become the
        # BOS token (nor any other special token).
        self._tok.encode_special_tokens = True
        config = _read_json(folder / "config.json")
        gen = _read_json(folder / "generation_config.json")
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        for key, value in _read_json(folder / "special_tokens_map.json").items():
            tok_cfg.setdefault(key, value)       # legacy file: tokenizer_config wins
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.special_tokens: dict[str, str] = {
            k: t for k in _SPECIAL_KEYS if (t := _token_text(tok_cfg.get(k))) is not None}
        eos = set(_ids(config.get("eos_token_id"))) | set(_ids(gen.get("eos_token_id")))
        if not eos and self.special_tokens.get("eos_token") in vocab:
            eos = {vocab[self.special_tokens["eos_token"]]}
        if not eos:
            eos = {vocab[n] for n in _EOS_NAMES if n in vocab}
        self.eos_token_ids: set[int] = eos
        bos = vocab.get(self.special_tokens.get("bos_token", ""))
        if bos is None:
            bos = config.get("bos_token_id", gen.get("bos_token_id"))
        if bos is None:
            bos = next((vocab[n] for n in _BOS_NAMES if n in vocab), None)
        self.bos_token_id: int | None = None if bos is None else int(bos)
        self.prefix_ids, self.suffix_ids = self._affixes()
        self.add_bos_default = bool(self.prefix_ids or self.suffix_ids)
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self.special_ids: set[int] = {i for i, t in added.items() if t.special}
        self.added_tokens: dict[str, bool] = {t.content: bool(t.special) for t in added.values()}
        self.chat_template: str | None = _chat_template(folder, tok_cfg)

    def _affixes(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a sequence, found
        by encoding one ordinary token with and without special tokens."""
        full_empty = self._tok.encode("", add_special_tokens=True).ids
        if not full_empty:
            return [], []
        probe = next((text for _, i in sorted(self._tok.get_vocab(with_added_tokens=False).items(),
                                              key=lambda kv: kv[1])
                      if (text := self._tok.decode([i])).strip()), None)
        if probe is not None:
            body = self._tok.encode(probe, add_special_tokens=False).ids
            full = self._tok.encode(probe, add_special_tokens=True).ids
            for k in range(len(full) - len(body) + 1):
                if body and full[k:k + len(body)] == body:
                    return full[:k], full[k + len(body):]
        return list(full_empty), []

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`. add_bos: a fresh sequence, with the special
        tokens this tokenizer adds to one (BOS for most Llama/Mistral
        checkpoints, none for SmolLM2 or Qwen2); False for a continuation."""
        return self._tok.encode(text, add_special_tokens=add_bos).ids

    def chat(self):
        """The model's chat template with this tokenizer (chat_template.Chat).
        ValueError when the model has no chat template."""
        from services.compute.model.chat_template import Chat

        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json chat_template); "
                             "send a prompt instead of messages")
        if self._tok_control is None:
            self._tok_control = HFTokenizer.from_str(self._json)
            self._tok_control.encode_special_tokens = False
        control = self._tok_control
        return Chat(self.chat_template, added_tokens=self.added_tokens, special_tokens=self.special_tokens,
                    encode=lambda s: control.encode(s, add_special_tokens=False).ids,
                    encode_text=lambda s: self._tok.encode(s, add_special_tokens=False).ids,
                    token_id=self._tok.token_to_id)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """`messages` ([{"role", "content"}]) rendered with the model's chat
        template, control tokens in the clients' strings kept as text.
        ValueError when the model has no chat template or it refuses the chat."""
        return self.chat().encode_messages(messages, add_generation_prompt)

    def encode_chat_turn(self, history: list[dict], new: list[dict], reply_end_token_id: int | None = None) -> list[int]:
        """The tokens that continue a chat session holding `history` with `new` (Chat.encode_turn)."""
        return self.chat().encode_turn(history, new, reply_end_token_id)

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
