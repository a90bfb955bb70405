"""`ChatTemplateTokenCounter`: exact per-message token spans from the model's own chat template.

Needs the `tokenization` extra (transformers, jinja2, tokenizers), imported only when a counter is
built; without it building one raises `MissingExtraError` saying how to install it.
Ownership follows DESIGN.md §1: every output of the template's message loop belongs to the message
being rendered (so role markers and other scaffolding belong to the message they frame); text before
the first message's output belongs to message 0, other unowned text to the message before it; the
generation prompt belongs to the reply. A token belongs to the owner of its first character."""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from akv.agent.counting import TokenLayout
from akv.agent.errors import ConfigError, MissingExtraError, TokenCountError
from akv.agent.payload import API_STYLES
from akv.agent.templating import sglang_template_inputs, template_content_format

_NO_INSTRUMENT = ("Macro", "CallBlock", "FilterBlock", "AssignBlock")
INSTALL_EXTRA = "python -m pip install -e '.[tokenization]' (from the AKV checkout)"


def _chat_template_utils() -> Any:
    """transformers' chat-template module; MissingExtraError when the tokenization extra is absent."""
    try:
        from jinja2 import nodes  # noqa: F401
        from transformers.utils import chat_template_utils
    except ImportError as exc:
        raise MissingExtraError(f"ChatTemplateTokenCounter needs the 'tokenization' extra (transformers, jinja2, "
                                f"tokenizers; {exc.name or exc} is missing): {INSTALL_EXTRA}") from exc
    return chat_template_utils


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered prompt: its text, token ids, and the owner of every token (message index, or
    `len(messages)` for the generation prompt)."""

    text: str
    token_ids: tuple[int, ...]
    owners: tuple[int, ...]
    layout: TokenLayout


class ChatTemplateTokenCounter:
    """Counts tokens by rendering the chat template with the tokenizer, as the server does.

    `tokenizer` is a transformers fast tokenizer with a chat template (or pass `chat_template`).
    Messages and tools are rendered as SGLang 0.5.16 hands them to the template
    (`akv.agent.templating.sglang_template_inputs`, with this template's content format). Both
    api_styles count the same: `api_style` only says where the AKV fields travel (top level, or
    under `extra_body` for the OpenAI SDK), and the server behind either is SGLang."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None) -> None:
        chat_template_utils = _chat_template_utils()
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ConfigError("ChatTemplateTokenCounter: the tokenizer has no chat template; pass chat_template=")
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("ChatTemplateTokenCounter needs a fast tokenizer (offset mapping)")
        self.tokenizer = tokenizer
        self.chat_template = template
        compile_template = getattr(chat_template_utils, "_compile_jinja_template", None)
        if compile_template is None:
            raise MissingExtraError("ChatTemplateTokenCounter needs transformers' chat-template environment "
                                    "(transformers.utils.chat_template_utils._compile_jinja_template), which this "
                                    f"transformers version does not have: {INSTALL_EXTRA}")
        environment = compile_template(template).environment
        self.content_format = template_content_format(template, environment.parse(template))
        self._instrumented = environment.from_string(_instrument(environment.parse(template)))
        self._nonce = secrets.token_hex(8)
        self._marker = re.compile("\x00" + self._nonce + r":(-|/|\d+)\x00")

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> ChatTemplateTokenCounter:
        """Load the tokenizer with transformers' AutoTokenizer (a local path needs no network)."""
        _chat_template_utils()
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path, **kwargs))

    def layout(self, messages: Sequence[Mapping[str, object]], *,
               tools: Sequence[Mapping[str, object]] | None = None,
               chat_template_kwargs: Mapping[str, object] | None = None,
               api_style: str = "sglang") -> TokenLayout:
        return self.render(messages, tools=tools, chat_template_kwargs=chat_template_kwargs,
                           api_style=api_style).layout

    def render(self, messages: Sequence[Mapping[str, object]], *,
               tools: Sequence[Mapping[str, object]] | None = None,
               chat_template_kwargs: Mapping[str, object] | None = None,
               api_style: str = "sglang", tool_choice: object = None) -> RenderedPrompt:
        """Render with the generation prompt, tokenize, and attribute every token. `messages`,
        `tools` and `tool_choice` are the payload's fields, as sent."""
        if api_style not in API_STYLES:
            raise ConfigError(f"api_style must be one of {list(API_STYLES)}, got {api_style!r}")
        inputs = sglang_template_inputs(messages, tools, tool_choice=tool_choice, content_format=self.content_format)
        prepared = list(inputs.messages)
        kwargs = dict(chat_template_kwargs or {})
        tools_list = list(inputs.tools) if inputs.tools else None
        text = self.tokenizer.apply_chat_template(prepared, tools=tools_list, tokenize=False,
                                                  add_generation_prompt=True, **kwargs)
        without = self.tokenizer.apply_chat_template(prepared, tools=tools_list, tokenize=False,
                                                     add_generation_prompt=False, **kwargs)
        by_identity = {id(m): i for i, m in enumerate(prepared)}
        marked = self._instrumented.render(
            messages=prepared, tools=tools_list, documents=None, add_generation_prompt=True,
            **{**self.tokenizer.special_tokens_map, **kwargs},
            __akv_open=lambda *objs: self._open(objs, by_identity), __akv_close=self._close)
        char_owner, plain = self._char_owners(marked)
        if plain != text:
            raise TokenCountError("instrumenting the chat template changed its output; this template is not "
                                  "supported by ChatTemplateTokenCounter")
        n = len(prepared)
        generation_start = len(without) if text.startswith(without) else _last_owned(char_owner) + 1
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = tuple(encoded["input_ids"])
        owners = []
        previous = 0
        for start, end in encoded["offset_mapping"]:
            if start >= generation_start:
                owner = n
            elif end > start:
                owner = _resolve(char_owner, start)
            else:
                owner = previous
            owners.append(owner)
            previous = owner
        return RenderedPrompt(text, ids, tuple(owners), _layout(owners, n))

    def _open(self, objs: tuple[object, ...], by_identity: dict[int, int]) -> str:
        for obj in reversed(objs):
            index = by_identity.get(id(obj))
            if index is not None:
                return f"\x00{self._nonce}:{index}\x00"
        return f"\x00{self._nonce}:-\x00"

    def _close(self) -> str:
        return f"\x00{self._nonce}:/\x00"

    def _char_owners(self, marked: str) -> tuple[list[int], str]:
        """Per character of the unmarked text: the innermost owning message, -1 where none."""
        owners: list[int] = []
        pieces: list[str] = []
        stack: list[int] = []
        position = 0
        for match in self._marker.finditer(marked):
            piece = marked[position:match.start()]
            pieces.append(piece)
            owners.extend([_innermost(stack)] * len(piece))
            token = match.group(1)
            if token == "/":
                if not stack:
                    raise TokenCountError("unbalanced ownership markers in the rendered template")
                stack.pop()
            else:
                stack.append(-1 if token == "-" else int(token))
            position = match.end()
        tail = marked[position:]
        pieces.append(tail)
        owners.extend([_innermost(stack)] * len(tail))
        return owners, "".join(pieces)


def _innermost(stack: list[int]) -> int:
    for owner in reversed(stack):
        if owner >= 0:
            return owner
    return -1


def _last_owned(char_owner: list[int]) -> int:
    for i in range(len(char_owner) - 1, -1, -1):
        if char_owner[i] >= 0:
            return i
    return -1


def _resolve(char_owner: list[int], position: int) -> int:
    """Owner of the character at `position`; unowned text goes to the previous owner, or message 0."""
    for i in range(position, -1, -1):
        if char_owner[i] >= 0:
            return char_owner[i]
    return 0


def _layout(owners: list[int], n_messages: int) -> TokenLayout:
    counts = [0] * (n_messages + 1)
    previous = 0
    for t, owner in enumerate(owners):
        if owner < previous:
            raise TokenCountError(f"token {t} belongs to message {owner} but follows a token of message "
                                  f"{previous}; the template does not render messages in order")
        counts[owner] += 1
        previous = owner
    spans = []
    start = 0
    for count in counts[:n_messages]:
        spans.append((start, start + count))
        start += count
    return TokenLayout(tuple(spans), counts[n_messages])


def _instrument(template: Any) -> Any:
    """Wrap every output statement inside a for loop with open/close marker calls that receive the
    loop variables in scope, innermost last."""
    from jinja2 import nodes

    def marker(name: str, args: list[Any]) -> Any:
        return nodes.Output([nodes.Call(nodes.Name(name, "load"), args, [], None, None)])

    def loop_names(target: Any) -> list[str]:
        return [n.name for n in target.find_all(nodes.Name)] if not isinstance(target, nodes.Name) \
            else [target.name]

    def statements(body: list[Any], scope: list[str]) -> list[Any]:
        out = []
        for node in body:
            if isinstance(node, nodes.Output) and scope:
                out.append(marker("__akv_open", [nodes.Name(v, "load") for v in scope]))
                out.append(node)
                out.append(marker("__akv_close", []))
            else:
                visit(node, scope)
                out.append(node)
        return out

    def visit(node: Any, scope: list[str]) -> None:
        if type(node).__name__ in _NO_INSTRUMENT or not isinstance(node, nodes.Stmt):
            return
        for field in node.fields:
            value = getattr(node, field)
            if isinstance(value, list) and all(isinstance(v, nodes.Node) for v in value):
                inner = scope + loop_names(node.target) if isinstance(node, nodes.For) and field == "body" \
                    else scope
                setattr(node, field, statements(value, inner))

    template.body = statements(template.body, [])
    return template
