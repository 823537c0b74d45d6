"""Chat records of ``shardwise prepare --sft``: ``messages`` rendered with the tokenizer's own chat template, and the
characters of the assistant turns that the loss is taken on.

The template is the Jinja2 text under ``chat_template`` in the tokenizer directory's ``tokenizer_config.json`` (or
its ``chat_template.jinja``), rendered the way Hugging Face tokenizers render it: a sandboxed environment with
``trim_blocks``/``lstrip_blocks`` and loop controls, the variables ``messages``, ``add_generation_prompt`` and the
tokenizer's special-token strings (``bos_token``, ``eos_token``, ...), the helpers ``raise_exception`` and
``strftime_now``, and a ``tojson`` filter that keeps non-ASCII text.

Where an assistant turn is (``assistant_spans``): render the conversation up to the turn with the generation prompt
(what a model is given before it answers), then through the turn; the turn's characters are what lies between.
Both renders must be prefixes of the whole conversation's render — templates that rewrite earlier turns depending
on what follows are refused in one line rather than masked approximately. ``token_mask`` turns those characters
into the loss mask over the conversation's tokens (the rule is in docs/data.md, "Chat data").

Like ``encode_worker.py`` this file is also loaded on its own by path in the encoding workers: it imports nothing
relative, and jinja2 only when a chat record is met.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

__all__ = ["ROLES", "TOKEN_KEYS", "INSTALL_DATA", "find_chat_template", "check_messages", "ChatRenderer",
           "token_mask"]

ROLES = ("system", "user", "assistant")
TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special-token strings a template sees by name (those the tokenizer configuration sets)."""
INSTALL_DATA = 'pip install "shardwise[data]"'


def _token_string(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...} in tokenizer_config.json
        value = value.get("content")
    return value if isinstance(value, str) else None


def find_chat_template(directory: Path) -> tuple[str, dict[str, str]]:
    """The chat template of the tokenizer in ``directory`` ("" when it has none) and the special-token strings
    the template may name. ``tokenizer_config.json``'s ``chat_template`` is a string or a list of named
    templates (the one named ``default`` is used); a ``chat_template.jinja`` file wins over both."""
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config's own values win
        path = directory / name
        if path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                raise ValueError(f"{str(path)!r} is not valid JSON; fix it or remove it from the tokenizer "
                                 f"directory") from None
            config.update(loaded if isinstance(loaded, dict) else {})
    template = config.get("chat_template") or ""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or ""
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    tokens = {k: s for k in TOKEN_KEYS if (s := _token_string(config.get(k))) is not None}
    return (template if isinstance(template, str) else ""), tokens


def check_messages(value: Any, where: str, field: str) -> list[dict[str, Any]]:
    """A record's ``messages`` checked: a non-empty list of {"role", "content"} objects, roles among ``ROLES``,
    contents strings, at least one assistant turn. One-line ``ValueError`` naming the record otherwise."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: field {field!r} is a {type(value).__name__ if value != [] else 'empty list'}, "
                         f"not a list of messages; store [{{\"role\": \"user\", \"content\": ...}}, ...]")
    for k, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: message {k} of {field!r} is not an object with \"role\" and \"content\"; "
                             f"write each message as {{\"role\": ..., \"content\": ...}}")
        if message["role"] not in ROLES:
            raise ValueError(f"{where}: message {k} has role {message['role']!r}; roles are {list(ROLES)}; rename "
                             f"it or leave the message out")
        if not isinstance(message["content"], str):
            raise ValueError(f"{where}: message {k}'s content is a {type(message['content']).__name__}, not a "
                             f"string; store the text as a JSON string")
    if not any(m["role"] == "assistant" for m in value):
        raise ValueError(f"{where}: the conversation has no assistant turn, so nothing to learn; add the "
                         f"assistant's answer or remove the record")
    return [dict(m) for m in value]


def _environment() -> Any:
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ModuleNotFoundError:
        raise ValueError(f"chat records need the jinja2 package to render the tokenizer's chat template; install "
                         f"it with: {INSTALL_DATA}") from None

    class Generation(Extension):  # ``{% generation %}...{% endgeneration %}``: the body, rendered as it is
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # jinja's own escapes HTML characters; templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatRenderer:
    """One compiled template and its special-token strings; ``render`` and ``assistant_spans`` per record."""

    def __init__(self, template: str, tokens: dict[str, str]) -> None:
        env = _environment()
        import jinja2

        self._errors: tuple[type[Exception], ...] = (jinja2.exceptions.TemplateError,)
        try:
            self._template = env.from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"the tokenizer's chat_template is not valid Jinja2 (line {exc.lineno}: {exc.message}); "
                             f"fix tokenizer_config.json's chat_template") from None
        self._tokens = dict(tokens)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **self._tokens)

    def _render(self, messages: Sequence[dict[str, Any]], prompt: bool, where: str) -> str:
        try:
            return self.render(messages, prompt)
        except self._errors as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"{where}: the chat template refused the conversation ({first}); fix the record's "
                             f"messages to the form the template accepts") from None

    def assistant_spans(self, messages: Sequence[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and, per assistant turn, the characters ``[start, end)`` between the render
        up to the turn with the generation prompt and the render through the turn (module docstring)."""
        text = self._render(messages, False, where)
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], True, where)
            through = self._render(messages[:i + 1], False, where)
            if not (text.startswith(before) and text.startswith(through) and len(before) < len(through)):
                raise ValueError(f"{where}: the chat template renders the conversation up to message {i} differently "
                                 f"from the start of the whole conversation, so its assistant turns cannot be found "
                                 f"exactly; use a template that renders earlier turns independently of later ones")
            spans.append((len(before), len(through)))
        return text, spans


def token_mask(offsets: Sequence[tuple[int, int]], ids: Sequence[int], spans: Sequence[tuple[int, int]],
               special_ids: set[int] | frozenset[int]) -> list[int]:
    """The loss mask ``(len(ids),)`` of a rendered conversation's tokens: 1 on each token that has a character in
    an assistant span, up to and including the span's last special token (the end-of-turn token: ``<|im_end|>``,
    ``<|eot_id|>``, ``</s>``); what a span holds after that (ChatML's newline) stays 0."""
    mask = [0] * len(ids)
    for start, end in spans:
        inside = [k for k, (s, e) in enumerate(offsets) if (s < end and e > start) or (s == e and start <= s < end)]
        last_special = max((j for j, k in enumerate(inside) if ids[k] in special_ids), default=len(inside) - 1)
        for k in inside[:last_special + 1]:
            mask[k] = 1
    return mask
