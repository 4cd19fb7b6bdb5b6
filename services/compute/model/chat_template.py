"""Chat templates: render `messages` with the model's Jinja template the way
transformers' `apply_chat_template` does, and tokenize the result so that the
template's own control tokens are control tokens while everything a client
wrote (roles, contents) is text.

Rendering: a sandboxed Jinja environment with transformers' options
(trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, a `tojson` that
does not escape HTML, `strftime_now`) and its variables (`messages`,
`add_generation_prompt`, the special-token strings `bos_token`, `eos_token`,
...).

Control tokens in client text (transformers' `sanitize_control_tokens=True`,
same result): every occurrence of a control token in a client string is
wrapped in two private-use markers before rendering (markers already in the
client's text are dropped first); the rendered string is split at the
markers; the marked pieces are encoded as plain text, the rest with the
template's control tokens recognised. A chat with no control-token text in it
tokenizes exactly as `apply_chat_template(..., tokenize=True)`.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Callable, Iterable

MARK_START, MARK_END = "\U000f0000", "\U000f0001"


class ChatTemplateError(ValueError):
    """The template refused the conversation (its own `raise_exception`, or a Jinja error)."""


@lru_cache(maxsize=8)
def compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e


@lru_cache(maxsize=8)
def template_literals(source: str) -> str:
    """The template's literal text and string constants, NUL-joined (so a
    search cannot match across two of them)."""
    import jinja2

    ast = compile_template(source).environment.parse(source)
    lits = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
    lits |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return "\0".join(sorted(lits))


def _alternation(tokens: Iterable[str]) -> str:
    longest_first = sorted(set(tokens), key=len, reverse=True)
    return "|".join(map(re.escape, longest_first)) or "(?!)"


def mark(text: str, control_re: re.Pattern) -> str:
    text = text.replace(MARK_START, "").replace(MARK_END, "")
    return control_re.sub(lambda m: f"{MARK_START}{m.group(0)}{MARK_END}", text)


def render(source: str, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
    import jinja2

    try:
        return compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               tools=None, documents=None, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template refused the messages: {e}") from e


class Chat:
    """The template and tokenizer of one model, for rendering client messages
    (marked) and tokenizing the rendered text (the markers say what is text).

    added_tokens: content -> special? for every added token of the tokenizer.
    special_tokens: template variables (bos_token, eos_token, ...).
    encode: text -> ids with added tokens recognised, no post-processor specials.
    encode_text: text -> ids with every special token spelled as text.
    token_id: an added token's id.
    """

    def __init__(self, source: str, *, added_tokens: dict[str, bool], special_tokens: dict[str, str],
                 encode: Callable[[str], list[int]], encode_text: Callable[[str], list[int]],
                 token_id: Callable[[str], int | None]):
        self.source, self.added_tokens, self.special_tokens = source, added_tokens, special_tokens
        self.encode, self.encode_text, self.token_id = encode, encode_text, token_id
        literals = template_literals(source)
        control = [t for t, special in added_tokens.items() if special or (t in literals and not t.isspace())]
        self.control_re = re.compile(_alternation(control))
        self.markers_re = re.compile(f"{MARK_START}({_alternation(added_tokens)}){MARK_END}|[{MARK_START}{MARK_END}]")

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """`messages` rendered, control-token text in client strings marked."""
        marked = [{k: mark(v, self.control_re) if isinstance(v, str) else v for k, v in m.items()}
                  for m in messages]
        return render(self.source, marked, add_generation_prompt, **self.special_tokens)

    def tokenize(self, text: str) -> list[int]:
        """Rendered (marked) text to ids: marked pieces as text, the rest with control tokens."""
        pieces = self.markers_re.split(text)     # [text, marked token or None, text, ...]
        newline = self.encode("\n")
        ids = self.encode(pieces[0])
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = i % 2 == 1
            enc = self.encode_text if as_text else self.encode
            # After a newline, so a SentencePiece tokenizer adds no prefix space mid-chat; the newline is then dropped.
            piece_ids = enc("\n" + piece)
            piece_ids = piece_ids[len(newline):] if piece_ids[:len(newline)] == newline else enc(piece)
            if as_text and self.token_id(piece) in piece_ids:
                raise ChatTemplateError(f"cannot keep {piece!r} as text: this tokenizer produces it from plain text")
            ids += piece_ids
        return ids

    def encode_messages(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.tokenize(self.render(messages, add_generation_prompt))

    def encode_turn(self, history: list[dict], new: list[dict], reply_end_token_id: int | None = None) -> list[int]:
        """Token ids that continue a session holding `history` (its last
        message the assistant's reply, as generated after the generation
        prompt) with the `new` messages: the closing the template gives that
        reply, then the new messages and the generation prompt. With
        `reply_end_token_id` the reply's tokens already end with that token,
        so the closing's own copy of it is skipped."""
        if not history or history[-1].get("role") != "assistant":
            raise ChatTemplateError("a chat session's history must end with the assistant's reply")
        asked = self.render(history[:-1], True)
        said = self.render(history, False)
        reply = mark(history[-1].get("content", ""), self.control_re)
        if not said.startswith(asked + reply):
            raise ChatTemplateError("this chat template does not render a reply after its generation prompt, "
                                    "so a session cannot continue it turn by turn")
        following = self.render(history + new, True)
        if not following.startswith(said):
            raise ChatTemplateError("this chat template renders the earlier turns differently once a new "
                                    "turn follows, so a session cannot continue it turn by turn")
        ids = self.tokenize(said[len(asked) + len(reply):] + following[len(said):])
        if reply_end_token_id is not None and ids[:1] == [reply_end_token_id]:
            ids = ids[1:]
        return ids


def encode_chat(source: str, messages: list[dict], *, added_tokens: dict[str, bool],
                special_tokens: dict[str, str], encode: Callable[[str], list[int]],
                encode_text: Callable[[str], list[int]], token_id: Callable[[str], int | None],
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered with template `source` (see Chat)."""
    return Chat(source, added_tokens=added_tokens, special_tokens=special_tokens, encode=encode,
                encode_text=encode_text, token_id=token_id).encode_messages(messages, add_generation_prompt)
