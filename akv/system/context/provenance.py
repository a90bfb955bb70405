"""Token provenance: which message owns each token of a rendered chat prompt (DESIGN.md §1).

The chat template is rendered once with every output instrumented: an output emitted while a
message object is the value of an enclosing ``for`` target (or macro argument) belongs to that
message; an output inside an ``{% if add_generation_prompt %}`` branch belongs to the reply
(owner ``n_messages``); output before the first owned character (preamble such as the system
block and tool list) belongs to message 0, and so does output between a message 0 rendered outside
the message loop (e.g. through a macro argument) and the next message. Output owned by no message
is left unmarked, so templates can test and slice it. The instrumented text, with its markers
removed, must equal the plain render (rendered to compare only when the template can read back its
own output: otherwise they are equal by construction), and the text is encoded once, as SGLang does
(``add_special_tokens=False``), or not at all when the server's ids for it are given and spell it
(byte-level BPE tokenizers, :mod:`~akv.system.context.byte_offsets`). A token takes the owner of
its first character; tokens whose characters span two owners are reported in ``boundary_tokens``.
Anything else that would need a guess (unowned text between messages, messages rendered out of
order, one message object listed twice, a later message's content rendered outside the message
loop, markers mangled by a template filter) raises :class:`ProvenanceError`.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from itertools import chain
from typing import Any

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from akv.system.context.byte_offsets import spelled_offsets

_MARK_FN = "akvprovenancemark"
_MARK_FILTER = "akvprovenance"
_GENERATION_FLAG = "add_generation_prompt"
_NONE = -1
_REPLY = -2
_DICT_ATTRIBUTES = frozenset(dir(dict))


class ProvenanceError(ValueError):
    """Ownership of the rendered prompt cannot be established without guessing."""


@dataclass(frozen=True)
class OwnedText:
    """A rendered prompt and the owner message of each character (``n_messages`` = the reply)."""

    text: str
    char_owners: np.ndarray
    n_messages: int


@dataclass(frozen=True)
class TokenProvenance:
    """Token ids of ``text`` (one encode), their character offsets and owner messages."""

    text: str
    token_ids: np.ndarray
    offsets: np.ndarray
    owners: np.ndarray
    boundary_tokens: np.ndarray
    n_messages: int


class _GenerationTag(Extension):
    """Accepts transformers' ``{% generation %}…{% endgeneration %}`` and renders the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@jinja2.pass_context
def _mark_filter(
    context: jinja2.runtime.Context, value: Any, candidates: tuple[Any, ...], loops: tuple[bool, ...], reply: bool
) -> str:
    """Forward to the render's marker (filters are called directly, without the sandbox's call check)."""
    return context.get(_MARK_FN)(value, candidates, loops, reply)


class _Environment(ImmutableSandboxedEnvironment):
    """Transformers' sandbox, with each attribute's safety remembered per (object type, name) (the
    check reads nothing else), and a plain dict's keys read without first failing an attribute
    lookup (a dict has no attribute of that name, so the sandbox would subscript it anyway)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = self._safe[key] = super().is_safe_attribute(obj, attr, value)
        return safe

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


def _environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers' ``apply_chat_template`` renders with."""
    env = _Environment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters[_MARK_FILTER] = _mark_filter
    return env


class ChatTemplate:
    """A chat template compiled twice: plain, and instrumented for per-character ownership."""

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source:
            raise ProvenanceError(f"chat_template: expected a non-empty string, got {source!r:.60}")
        env = _environment()
        self._plain = env.from_string(source)
        tree = env.parse(source)
        self._rereads_output = _rereads_output(tree)
        _Instrumenter().visit(tree, (), False)
        self._instrumented = env.from_string(tree)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The plain render, as ``tokenizer.apply_chat_template(..., tokenize=False)`` produces it."""
        return self._plain.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )

    def render_owned(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> OwnedText:
        """Render once with ownership; checks the result against the plain render when the template
        can read back its own output (only then can the markers have changed it)."""
        index = _identity_index(messages)
        nonce = secrets.token_hex(8)

        def mark(value: Any, candidates: tuple[Any, ...], loops: tuple[bool, ...], reply: bool) -> str:
            owner, in_loop = (_REPLY, False) if reply else _owner_of(candidates, loops, index, messages)
            if owner == _NONE:
                return str(value)  # owns nothing: unmarked, so templates may slice and test it as plain text
            return f"\x00{nonce}{'L' if in_loop else 'B'}{owner}\x00{str(value)}\x00{nonce}E\x00"

        raw = self._instrumented.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
            **{_MARK_FN: mark},
        )
        text, char_owners, in_loop = _strip_markers(raw, nonce, len(messages))
        plain = (self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables)
                 if self._rereads_output else text)
        if text != plain:
            at = next((i for i, (a, b) in enumerate(zip(text, plain)) if a != b), min(len(text), len(plain)))
            raise ProvenanceError(
                f"chat_template: instrumented render differs from the plain render at character {at} "
                f"({text[at:at + 20]!r} vs {plain[at:at + 20]!r}); a filter rewrote template output"
            )
        owners = _settle_owners(char_owners, in_loop, text, len(messages))
        _check_rendered_elsewhere(messages, owners, text)
        return OwnedText(text=text, char_owners=owners, n_messages=len(messages))


def token_provenance(owned: OwnedText, tokenizer: Any, prompt_ids: Sequence[int] | None = None) -> TokenProvenance:
    """Encode ``owned.text`` once (no added special tokens) and give every token its owner.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers fast tokenizer. ``prompt_ids``, the
    ids the server encoded its render of the same prompt to, are taken instead of encoding when their
    bytes spell ``owned.text`` (:func:`~akv.system.context.byte_offsets.spelled_offsets`).
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "encode") or not hasattr(backend, "get_vocab_size"):
        name = type(tokenizer).__name__
        raise ProvenanceError(f"tokenizer: {name} gives no character offsets (needs a fast tokenizer)")
    offsets = None
    if prompt_ids is not None:
        ids = np.fromiter(prompt_ids, dtype=np.int64, count=len(prompt_ids))
        offsets = spelled_offsets(backend, ids, owned.text)
    if offsets is None:
        ids, offsets = _encode(backend, owned.text)
    owners, boundary = _token_owners(offsets, owned)
    for arr in (ids, offsets, owners, boundary):
        arr.flags.writeable = False
    return TokenProvenance(owned.text, ids, offsets, owners, boundary, owned.n_messages)


@lru_cache(maxsize=16)
def chat_template(source: str) -> ChatTemplate:
    """Compiled template for ``source``, cached (compiling costs far more than rendering)."""
    return ChatTemplate(source)


def prompt_provenance(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    template: str | None = None,
    prompt_ids: Sequence[int] | None = None,
    **variables: Any,
) -> TokenProvenance:
    """Render and encode a request the way SGLang does with a transformers fast tokenizer.

    Uses ``template`` or the tokenizer's ``chat_template``; template variables are the tokenizer's
    special tokens overridden by ``variables`` (e.g. ``chat_template_kwargs``), as transformers does.
    ``prompt_ids``: the server's own encoding of the render, if known (see :func:`token_provenance`).
    """
    source = template if template is not None else getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str):
        raise ProvenanceError("chat_template: the tokenizer has no chat template and none was given")
    context = {**getattr(tokenizer, "special_tokens_map", {}), **variables}
    owned = chat_template(source).render_owned(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, **context
    )
    return token_provenance(owned, tokenizer, prompt_ids)


def _identity_index(messages: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    index: dict[int, int] = {}
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ProvenanceError(f"messages[{i}]: expected an object, got {type(message).__name__}")
        earlier = index.setdefault(id(message), i)
        if earlier != i:
            raise ProvenanceError(f"messages[{i}]: same object as messages[{earlier}]; ownership would be ambiguous")
    return index


def _owner_of(
    candidates: tuple[Any, ...], loops: tuple[bool, ...], index: dict[int, int], messages: Sequence[Any]
) -> tuple[int, bool]:
    """The innermost message in scope and whether a ``for`` target (not a macro argument) bound it."""
    for value, in_loop in zip(reversed(candidates), reversed(loops)):
        i = index.get(id(value))
        if i is not None and messages[i] is value:
            return i, in_loop
    return _NONE, False


class _Instrumenter:
    """Wraps every output expression in a call that records the innermost message in scope.

    ``scope`` holds ``(name, bound by a for loop)`` pairs, innermost last."""

    def visit(self, node: nodes.Node, scope: tuple[tuple[str, bool], ...], reply: bool) -> None:
        if isinstance(node, nodes.Output):
            # One marker per output statement: its pieces share the scope, so they share the owner.
            children = [nodes.Const(c.data) if isinstance(c, nodes.TemplateData) else c for c in node.nodes]
            if children:
                node.nodes = [self._wrap(children[0] if len(children) == 1 else nodes.Concat(children), scope, reply)]
            return
        if isinstance(node, nodes.For):
            inner = scope + tuple((name, True) for name in _target_names(node.target))
            self.visit(node.iter, scope, reply)
            for child in node.body:
                self.visit(child, inner, reply)
            for child in node.else_:
                self.visit(child, scope, reply)
            if node.test is not None:
                self.visit(node.test, inner, reply)
            return
        if isinstance(node, (nodes.Macro, nodes.CallBlock)):
            inner = scope + tuple((arg.name, False) for arg in node.args)
            for child in node.body:
                self.visit(child, inner, reply)
            return
        if isinstance(node, nodes.If):
            self.visit(node.test, scope, reply)
            gen = reply or _requires_generation(node.test)
            for child in node.body:
                self.visit(child, scope, gen)
            for child in node.elif_:
                self.visit(child, scope, reply)
            for child in node.else_:
                self.visit(child, scope, reply)
            return
        for child in node.iter_child_nodes():
            self.visit(child, scope, reply)

    @staticmethod
    def _wrap(child: nodes.Expr, scope: tuple[tuple[str, bool], ...], reply: bool) -> nodes.Expr:
        candidates = nodes.Tuple([nodes.Name(name, "load") for name, _ in scope], "load")
        loops = nodes.Const(tuple(in_loop for _, in_loop in scope))
        return nodes.Filter(child, _MARK_FILTER, [candidates, loops, nodes.Const(reply)], [], None, None)


_CAPTURES = (nodes.Macro, nodes.CallBlock, nodes.AssignBlock, nodes.FilterBlock, nodes.Block, nodes.Extends,
             nodes.Include, nodes.Import, nodes.FromImport)


def _rereads_output(tree: nodes.Template) -> bool:
    """True when rendered output can become a value again (macros, ``caller()``, ``set`` and
    ``filter`` blocks, blocks, other templates, recursive loops); otherwise every output goes
    straight to the result, so the instrumented render without markers is the plain render."""
    return any(True for _ in tree.find_all(_CAPTURES)) or any(f.recursive for f in tree.find_all(nodes.For))


def _requires_generation(test: nodes.Node) -> bool:
    """True when ``test`` can only hold with ``add_generation_prompt`` set (a bare reference, an
    ``is true`` test of it, or a conjunction containing one)."""
    if isinstance(test, nodes.Name):
        return test.name == _GENERATION_FLAG
    if isinstance(test, nodes.Test):
        return test.name == "true" and _requires_generation(test.node)
    if isinstance(test, nodes.And):
        return _requires_generation(test.left) or _requires_generation(test.right)
    return False


def _target_names(target: nodes.Node) -> tuple[str, ...]:
    if isinstance(target, nodes.Name):
        return (target.name,)
    return tuple(n.name for n in target.find_all(nodes.Name))


PIECE_CHARS = 1 << 13
"""Texts longer than this many characters are encoded in pieces of about this size (:func:`_encode`)."""


def _encode(backend: Any, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Ids and character offsets of ``text`` encoded without added special tokens. A long text is
    encoded in pieces that each start at a special token, where the tokenizer splits anyway (added
    tokens are matched before normalisation and pre-tokenisation), when its normaliser and
    pre-tokeniser cannot tell a piece's start from the text's: the same ids, in time linear in the
    text (one encode of a very long string costs more per token)."""
    starts = _piece_starts(backend, text) if len(text) > PIECE_CHARS else []
    bounds = [0, *starts, len(text)]
    encodings = [backend.encode(text[a:b], add_special_tokens=False) for a, b in zip(bounds, bounds[1:])]
    ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int64)
    offsets = np.fromiter(chain.from_iterable(chain.from_iterable(e.offsets) for e in encodings), dtype=np.int64)
    offsets = offsets.reshape(-1, 2)
    sizes = [len(e.ids) for e in encodings]
    offsets += np.repeat(np.asarray(bounds[:-1], dtype=np.int64), sizes)[:, None]
    return ids, offsets


def _piece_starts(backend: Any, text: str) -> list[int]:
    """Where the pieces of ``text`` start: the first special token (one no whitespace stripping
    touches) after every ``PIECE_CHARS`` characters; none for a tokenizer that treats a piece's
    start differently (a prefix space, a Metaspace, a normaliser other than NFC)."""
    pattern = _splitting_tokens(backend)
    if pattern is None:
        return []
    starts: list[int] = []
    at = PIECE_CHARS
    while at < len(text):
        found = pattern.search(text, at)
        if found is None:
            break
        starts.append(found.start())
        at = found.start() + PIECE_CHARS
    return starts


@lru_cache(maxsize=8)
def _splitting_tokens(backend: Any) -> re.Pattern[str] | None:
    config = json.loads(backend.to_str())
    if (config.get("normalizer") or {}).get("type") not in (None, "NFC"):
        return None
    if not _start_blind(config.get("pre_tokenizer")):
        return None
    tokens = [t["content"] for t in config.get("added_tokens", ())
              if t.get("special") and not t.get("lstrip") and not t.get("rstrip") and t.get("content")]
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))) if tokens else None


def _start_blind(pre_tokenizer: Any) -> bool:
    """True when the pre-tokeniser treats the start of a text like any other point (no prefix space)."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_start_blind(p) for p in pre_tokenizer.get("pretokenizers", ()))
    if kind == "ByteLevel":
        return not pre_tokenizer.get("add_prefix_space")
    return kind in ("Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit")


def _strip_markers(raw: str, nonce: str, n_messages: int) -> tuple[str, np.ndarray, np.ndarray]:
    """Remove the markers; per character, the innermost owned marker (-1 none, ``n_messages`` reply)
    and whether any enclosing marker's message was bound by a ``for`` loop."""
    parts = re.split(f"\x00{nonce}([BL]-?[0-9]+|E)\x00", raw)
    texts = parts[0::2]
    owners = [_NONE]
    loops = [False]
    stack: list[tuple[int, bool]] = []
    current, in_loop = _NONE, False
    for tag in parts[1::2]:
        if tag == "E":
            if not stack:
                raise ProvenanceError("chat_template: output markers are unbalanced; a filter rewrote template output")
            current, in_loop = stack.pop()
        else:
            stack.append((current, in_loop))
            code = int(tag[1:])
            current = n_messages if code == _REPLY else code
            in_loop = in_loop or tag[0] == "L"
        owners.append(current)
        loops.append(in_loop)
    text = "".join(texts)
    if stack or "\x00" + nonce in text:
        raise ProvenanceError("chat_template: output markers are unbalanced; a filter rewrote template output")
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    return (text, np.repeat(np.asarray(owners, dtype=np.int64), lengths),
            np.repeat(np.asarray(loops, dtype=bool), lengths))


def _settle_owners(char_owners: np.ndarray, in_loop: np.ndarray, text: str, n_messages: int) -> np.ndarray:
    """Give the preamble, and the text right after a message 0 rendered outside the message loop, to
    message 0; reject unowned text elsewhere and out-of-order owners."""
    owned = np.flatnonzero(char_owners != _NONE)
    first = int(owned[0]) if owned.size else len(text)
    if first and n_messages:
        char_owners[:first] = 0
    zero = np.flatnonzero(char_owners[first:] == 0) + first
    if zero.size and not in_loop[zero].any():
        after = int(zero[-1]) + 1
        others = np.flatnonzero(char_owners[after:] != _NONE)
        end = after + int(others[0]) if others.size else len(text)
        if end == len(text) or char_owners[end] != 0:
            char_owners[after:end] = 0
    unowned = np.flatnonzero(char_owners == _NONE)
    if unowned.size:
        at = int(unowned[0])
        raise ProvenanceError(
            f"chat_template: character {at} ({text[at:at + 20]!r}) is emitted outside any message loop "
            "after the first message; its owner would be a guess"
        )
    backwards = np.flatnonzero(char_owners[1:] < char_owners[:-1])
    if backwards.size:
        at = int(backwards[0]) + 1
        raise ProvenanceError(
            f"chat_template: message {int(char_owners[at])} is rendered after message {int(char_owners[at - 1])} "
            f"(character {at}, {text[at:at + 20]!r}); messages must render in order"
        )
    char_owners.flags.writeable = False
    return char_owners


def _check_rendered_elsewhere(messages: Sequence[Mapping[str, Any]], owners: np.ndarray, text: str) -> None:
    """A later message that owns nothing yet whose content is in the prompt was rendered outside its
    loop (e.g. folded into the preamble): its text would silently count as another message's.
    ``owners`` is non-decreasing (checked by :func:`_settle_owners`)."""
    changes = np.flatnonzero(owners[1:] != owners[:-1]) + 1
    owning = set(owners[:1].tolist()) | set(owners[changes].tolist())
    for i in range(1, len(messages)):
        content = messages[i].get("content")
        if i not in owning and isinstance(content, str) and content and content in text:
            raise ProvenanceError(
                f"messages[{i}]: its content is rendered outside a message loop, so no characters are "
                "attributed to it; ownership would be a guess"
            )


def _token_owners(offsets: np.ndarray, owned: OwnedText) -> tuple[np.ndarray, np.ndarray]:
    n = offsets.shape[0]
    chars = owned.char_owners
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    starts, ends = offsets[:, 0], offsets[:, 1]
    if starts.min() < 0 or ends.max() > chars.shape[0] or np.any(ends < starts):
        raise ProvenanceError("tokenizer: offsets do not index the rendered text")
    sized = ends > starts
    owners = np.full(n, -1, dtype=np.int64)
    owners[sized] = chars[starts[sized]]
    # Zero-width tokens take the owner of the previous sized token (message 0 at the start).
    filled = np.maximum.accumulate(np.where(sized, np.arange(n), -1))
    owners = np.where(filled >= 0, owners[np.maximum(filled, 0)], 0)
    boundary = np.flatnonzero(sized & (chars[np.maximum(ends - 1, 0)] != owners))
    if np.any(owners[1:] < owners[:-1]):
        at = int(np.flatnonzero(owners[1:] < owners[:-1])[0]) + 1
        raise ProvenanceError(f"tokenizer: token {at} maps back to message {int(owners[at])} after a later message")
    return owners, boundary
