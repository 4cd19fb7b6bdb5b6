"""Our Tokenizer against transformers' AutoTokenizer on the same folder, for
the tokenizer layouts of the supported families (built here, small and
seeded: no hub):

- llama3: byte-level BPE, tokenizer.json's TemplateProcessing adds <|begin_of_text|>;
- qwen2 / smollm2: byte-level BPE, ByteLevel post-processor, no BOS (bos_token null);
- mistral (Llama 2 layout): SentencePiece-style Metaspace BPE, TemplateProcessing adds <s>;
- add_eos: the same adding <s> and </s> (what add_eos_token=true saves);
- flags_only: add_bos_token=true in tokenizer_config but no post-processor:
  transformers 5 ignores the flag when tokenizer.json exists, so no BOS;
- bare: a tokenizer.json with no post-processor and no tokenizer_config (no BOS).

Plain text encodes to the same ids (BOS/EOS included); chats render and
encode as transformers' apply_chat_template(..., sanitize_control_tokens=True):
the template's control tokens are tokens, a client's control-token text is text.
"""
from __future__ import annotations

import inspect
import json

import pytest

from services.compute.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello there!",
          "What is the capital of France? Paris is the capital of France.",
          "Numbers: 12 345 6789. Symbols: <>[]{}|_", "héllo café naïve", "You are a helpful assistant.", "a/b c|d"] * 20
TEXTS = ["Hello world", " leading space", "The capital of France is Paris.", "line\nbreak\ttab",
         "héllo café", "12 + 345 = 357", ""]

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}"
          "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
          "+ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"},
     {"role": "assistant", "content": "Hello there!"}, {"role": "user", "content": "  Numbers: 12 345  "}],
]


def _byte_bpe(specials: list[str]):
    from tokenizers import Tokenizer as Raw, decoders, models, pre_tokenizers, trainers

    raw = Raw(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return raw


def _metaspace_bpe(specials: list[str]):
    from tokenizers import Tokenizer as Raw, decoders, models, pre_tokenizers, trainers

    raw = Raw(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        show_progress=False))
    return raw


def _family(name: str, folder):
    from tokenizers import processors

    cfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if name == "llama3":
        specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
        raw = _byte_bpe(specials)
        raw.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1",
                                          special_tokens=[("<|begin_of_text|>", 0)])])
        cfg.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3)
    elif name == "qwen2":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        raw = _byte_bpe(specials)
        raw.post_processor = processors.ByteLevel(trim_offsets=False)
        cfg.update(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML)
    elif name in ("mistral", "add_eos", "flags_only"):
        specials = ["<unk>", "<s>", "</s>"]
        raw = _metaspace_bpe(specials)
        eos = name == "add_eos"
        if name != "flags_only":
            raw.post_processor = processors.TemplateProcessing(
                single="<s> $A" + (" </s>" if eos else ""),
                pair="<s> $A" + (" </s>" if eos else "") + " <s>:1 $B:1" + (" </s>:1" if eos else ""),
                special_tokens=[("<s>", 1), ("</s>", 2)])
        cfg.update(bos_token="<s>", eos_token="</s>", unk_token="<unk>", add_bos_token=True,
                   add_eos_token=name == "add_eos", chat_template=MISTRAL)
    elif name == "bare":
        raw = _byte_bpe(["<s>", "</s>"])
        cfg = None
    else:
        raise ValueError(name)
    raw.save(str(folder / "tokenizer.json"))
    if cfg is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


FAMILIES = ["llama3", "qwen2", "mistral", "add_eos", "flags_only", "bare"]
EXPECT = {  # (prefix tokens, suffix tokens) on a fresh sequence
    "llama3": (["<|begin_of_text|>"], []), "qwen2": ([], []), "mistral": (["<s>"], []),
    "add_eos": (["<s>"], ["</s>"]), "flags_only": ([], []), "bare": ([], []),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = _family(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


def test_encode_matches_transformers(family):
    name, ours, hf = family
    pre, suf = EXPECT[name]
    assert ours.prefix_ids == [ours.token_to_id(t) for t in pre]
    assert ours.suffix_ids == [ours.token_to_id(t) for t in suf]
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], (name, text)
        assert ours.encode(text, add_bos=False) == hf(text, add_special_tokens=False)["input_ids"]


def test_special_token_text_in_a_prompt_is_text(family):
    name, ours, hf = family
    for token in hf.all_special_tokens:
        ids = ours.encode(f"a {token} b", add_bos=False)
        assert hf.convert_tokens_to_ids(token) not in ids, (name, token)
        assert ours.decode(ids) == f"a {token} b"


def _hf_chat(hf, messages, sanitize: bool):
    kw = {"sanitize_control_tokens": True} if sanitize else {}
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


SANITIZES = "sanitize_control_tokens" in inspect.signature(
    transformers.PreTrainedTokenizerBase.apply_chat_template).parameters


def test_chat_matches_apply_chat_template(family):
    name, ours, hf = family
    if ours.chat_template is None:
        with pytest.raises(ValueError, match="no chat template"):
            ours.encode_chat(CHATS[0])
        return
    for messages in CHATS:
        if name in ("mistral", "add_eos", "flags_only"):
            messages = [m for m in messages if m["role"] != "system"]
        assert ours.encode_chat(messages) == _hf_chat(hf, messages, sanitize=False), name


@pytest.mark.skipif(not SANITIZES, reason="this transformers has no apply_chat_template(sanitize_control_tokens=)")
def test_chat_control_tokens_in_content_stay_text(family):
    name, ours, hf = family
    if ours.chat_template is None:
        return
    specials = [t for t in hf.all_special_tokens if t]
    content = "Hi " + " x ".join(specials) + " \U000f0000end"
    messages = [{"role": "user", "content": content}]
    got = ours.encode_chat(messages)
    assert got == _hf_chat(hf, messages, sanitize=True), name
    injected = _hf_chat(hf, messages, sanitize=False)
    assert got != injected
    # Every special token in `got` is one the template wrote: the same ones as for a harmless message.
    harmless = ours.encode_chat([{"role": "user", "content": "Hi"}])
    assert [i for i in got if i in ours.special_ids] == [i for i in harmless if i in ours.special_ids]


def test_template_errors_are_value_errors(tmp_path):
    ours = Tokenizer(_family("mistral", tmp_path))
    with pytest.raises(ValueError, match="roles must alternate"):
        ours.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
