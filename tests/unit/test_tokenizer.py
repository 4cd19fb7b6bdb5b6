"""Tokenizer on the default model folder: round trips, special tokens, and the
incremental decoder never emits half a character."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpop.default_model import build_placeholder
from kvpop.paths import DEFAULT_MODEL_DIR
from services.compute.tokenizer import Tokenizer

SAMPLES = ["", "hello world", "  leading and trailing  ", "line\nbreak\ttab",
           "héllo wörld", "日本語のテキスト", "emoji 🙂👍🏽 mix", "r0 = 17; r1 = r0 + 5 -> 22"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def placeholder_tok(tmp_path_factory):
    return Tokenizer(build_placeholder(tmp_path_factory.mktemp("p")))


def stream(tok, ids):
    dec = tok.incremental_decoder()
    deltas = [dec.push(i) for i in ids]
    return deltas, dec.flush()


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    if tok.bos_token_id is not None:
        assert ids[0] == tok.bos_token_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False) == (ids[1:] if tok.bos_token_id is not None else ids)


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_decoder_matches_full_decode(tok, text):
    ids = tok.encode(text, add_bos=False)
    deltas, rest = stream(tok, ids)
    assert "".join(deltas) + rest == text
    assert rest == ""
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_incremental_decoder_any_text(tok, text):
    ids = tok.encode(text, add_bos=False)
    deltas, rest = stream(tok, ids)
    assert "".join(deltas) + rest == tok.decode(ids)


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
