"""Tokenizer: round trips and specials on the byte-level placeholder
tokenizer, streaming (incremental decoder) on it, on a SentencePiece-style
tokenizer and on whatever models/default ships."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpop.models.default_model import build_tokenizer
from kvpop.runtime.paths import DEFAULT_MODEL_DIR
from services.compute.model.tokenizer import Tokenizer

SAMPLES = ["", "hello world", "  leading and trailing  ", "line\nbreak\ttab",
           "héllo wörld", "日本語のテキスト", "emoji 🙂👍🏽 mix", "r0 = 17; r1 = r0 + 5 -> 22"]


@pytest.fixture(scope="module")
def placeholder_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("placeholder_tok")
    build_tokenizer().save(str(d / "tokenizer.json"))
    return Tokenizer(d)


@pytest.fixture(scope="module")
def default_tok():
    """Whatever models/default ships (placeholder or trained): no assumptions
    about its vocabulary beyond having specials."""
    return Tokenizer(DEFAULT_MODEL_DIR)


def stream(tok, ids):
    dec = tok.incremental_decoder()
    deltas = [dec.push(i) for i in ids]
    return deltas, dec.flush()


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(placeholder_tok, text):
    tok = placeholder_tok
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False) == ids[1:]


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_decoder_matches_full_decode(placeholder_tok, text):
    ids = placeholder_tok.encode(text, add_bos=False)
    deltas, rest = stream(placeholder_tok, ids)
    assert "".join(deltas) + rest == text
    assert rest == ""
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_incremental_decoder_any_text(placeholder_tok, text):
    ids = placeholder_tok.encode(text, add_bos=False)
    deltas, rest = stream(placeholder_tok, ids)
    assert "".join(deltas) + rest == text


def test_default_model_tokenizer(default_tok):
    t = default_tok
    assert t.eos_token_ids and all(0 <= i < t.vocab_size for i in t.eos_token_ids)
    assert t.bos_token_id is not None and t.encode("", add_bos=True) == [t.bos_token_id]
    # Tokens that decode to whole characters on their own; random sequences of them.
    ok = [i for i in range(t.vocab_size)
          if i not in t.special_ids and (s := t.decode([i])) and "\ufffd" not in s]
    assert len(ok) > 10
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = [ok[j] for j in torch.randint(0, len(ok), (12,), generator=g).tolist()]
        text = t.decode(ids)
        deltas, rest = stream(t, ids + sorted(t.eos_token_ids)[:1])
        assert "".join(deltas) + rest == text
        assert t.decode(t.encode(text)) == text


def test_placeholder_specials(placeholder_tok):
    t = placeholder_tok
    assert t.vocab_size == 259
    assert t.bos_token_id == 1 and t.eos_token_ids == {2}
    assert t.token_to_id("<pad>") == 0 and t.token_to_id("</s>") == 2
    # byte b is id 3 + b; a 4-byte character is 4 tokens.
    assert t.encode("A", add_bos=False) == [3 + ord("A")]
    assert len(t.encode("🙂", add_bos=False)) == 4
    # special tokens are dropped from text, never spelled out
    assert t.decode([1, 3 + ord("h"), 3 + ord("i"), 2]) == "hi"


def test_multibyte_character_waits_for_its_last_byte(placeholder_tok):
    ids = placeholder_tok.encode("a🙂b", add_bos=False)
    deltas, _ = stream(placeholder_tok, ids)
    assert deltas == ["a", "", "", "", "🙂", "b"]


def test_incremental_decoder_long_output_and_eos(placeholder_tok):
    t = placeholder_tok
    text = "é" * 200
    deltas, rest = stream(t, t.encode(text, add_bos=False) + [2])
    assert "".join(deltas) + rest == text


def test_truncated_character_flushes_replacement(placeholder_tok):
    ids = placeholder_tok.encode("ok🙂", add_bos=False)[:-1]
    deltas, rest = stream(placeholder_tok, ids)
    assert "".join(deltas) == "ok" and rest == "\ufffd"


def test_missing_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json not found"):
        Tokenizer(tmp_path)


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory):
    """A SentencePiece-style tokenizer (Llama/Mistral family): decoding a lone
    '▁w' token drops its space, which a naive per-token decoder would lose."""
    import json

    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(set("▁abcdefghijklmnopqrstuvwxyzé日本")):
        vocab[ch] = len(vocab)
    vocab["▁h"], vocab["▁w"] = len(vocab), len(vocab) + 1
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[("▁", "h"), ("▁", "w")], unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    raw.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    d = tmp_path_factory.mktemp("metaspace")
    raw.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2]}))
    return d


def test_metaspace_streaming_keeps_spaces(metaspace_dir):
    t = Tokenizer(metaspace_dir)
    assert t.bos_token_id == 1 and t.eos_token_ids == {2}
    text = "hello world é日本 how"
    ids = t.encode(text, add_bos=False)
    assert t.decode([t.token_to_id("▁w")]) == "w"  # the trap
    deltas, rest = stream(t, ids)
    assert "".join(deltas) + rest == text
    # Continuing after a prompt: the first generated word keeps its space.
    prompt = t.encode("hello", add_bos=True)
    dec = t.incremental_decoder(prompt)
    assert "".join(dec.push(i) for i in t.encode("hello world", add_bos=False)[5:]) == " world"
