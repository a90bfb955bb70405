"""The reference engine: render with provenance -> compile -> cache plan -> execute with the
reference model (on the CPU, or on another torch device) -> sample -> publish the new KV -> usage.

Requests take turns: every step (render and compile, admission, the prompt's forward, each generated
token, publishing) holds the engine alone, granted in arrival order, so concurrent requests interleave
token by token and a short request never waits for a long one to finish. Between its turns a request
hands each token to its caller, who may take as long as it likes there without holding up the others.
A request whose KV does not fit beside the running ones waits until they give enough slots back.
KV lives in FP32 slot pools shared with the cache core's radix tree, so later requests reuse every
version whose whole token-and-event history matches. A request takes all its KV slots at admission
(prompt and decode) and gives back everything it holds when it fails at any later step, so a failure
leaves the pool and the tree as they were.

Bit-reproducible: every forward runs on a pinned number of threads (some BLAS kernels split their
sums by thread count), keys are summed in token order whichever slots hold them, and the prompt's last
token runs alone, so the same request gives bitwise the same log-probs cold, over its own cached
prompt, and in another process. A request that reuses only part of another's prompt computes its
new tokens in forwards of other sizes, and a matrix product's rounding depends on its row count, so
it may differ from its own cold run in the last bits (a few 1e-6 in log-prob on the tiny test models).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
import torch

from akv.agent.templating import template_content_format
from akv.system.cache import ActiveRequest, CacheCore, CacheFull, SlotPool
from akv.system.cache.occurrence import cold_plan
from akv.system.context.compiler import ProgramError
from akv.system.context.limits import live_length, live_length_problem
from akv.system.context.program import ContextProgram
from akv.system.context.provenance import ChatTemplate, chat_template, token_provenance
from akv.system.context.request import compile_rules, template_for
from akv.system.context.spans import SpanError
from akv.system.reference.executor import PagedKV, run_prefill
from akv.system.reference.loading import load_reference_model
from akv.system.reference.paged import forward_paged
from akv.system.reference_server.model_dir import ModelDir, load_model_dir
from akv.system.reference_server.protocol import ChatRequest, RequestError
from akv.system.reference_server.responses import PromptUsage, TokenChoice, TokenStep
from akv.system.reference_server.sampling import Sampler
from akv.system.reference_server.text import TextTracker

DEFAULT_KV_SLOTS = 16384
DEFAULT_THREADS = 1
TOP_CANDIDATES = 20

OnToken = Callable[[TokenStep, str], None]


class EngineBusy(RuntimeError):
    """The KV pool cannot hold the request while requests this engine does not run hold slots (they
    were admitted through its cache core directly); it may fit later."""


@dataclass(frozen=True)
class Prepared:
    """A request rendered and compiled, ready to run; ``max_new_tokens`` respects the context limit,
    and ``kv_slots`` (what a cold start of the request takes, decode included) fits the pool."""

    program: ContextProgram
    max_new_tokens: int
    kv_slots: int


@dataclass(frozen=True)
class Generation:
    """The finished reply: ``steps`` has one entry per generated token (the end token included)."""

    token_ids: tuple[int, ...]
    text: str
    steps: tuple[TokenStep, ...]
    finish_reason: str
    usage: PromptUsage


class Engine:
    """A model directory served by the reference model on ``device``, with a radix-tree KV cache of
    ``kv_slots``; prompts run in forwards of at most ``prefill_chunk`` queries where given (the same
    arithmetic per query, a smaller attention score matrix); every forward runs on ``threads`` torch
    threads, whatever the process was set to (one by default: the same bits on any machine with the same
    kernels, and no oversubscription on a busy one). Safe to call from many threads: requests take turns."""

    def __init__(self, model_path: str | Path, *, name: str | None = None, kv_slots: int = DEFAULT_KV_SLOTS,
                 device: str | torch.device = "cpu", prefill_chunk: int | None = None,
                 threads: int = DEFAULT_THREADS) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}")
        if type(threads) is not int or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        self.files: ModelDir = load_model_dir(model_path)
        self.model = load_reference_model(self.files.path, dtype=torch.float32, device=device)
        self.prefill_chunk = prefill_chunk
        self.threads = threads
        self.model_name = name or self.files.path.name
        self.max_context = self.files.max_context
        self.template = ChatTemplate(self.files.chat_template)
        self.content_format = _content_format(self.files.chat_template)
        self.kv = PagedKV.empty(self.model, kv_slots + 1)
        self.pool = SlotPool(kv_slots)
        self.cache = CacheCore(self.pool)
        self._turns = _Turns()
        self._released = threading.Condition()  # a running request gave its slots back
        self._running = 0  # requests admitted by generate() that still hold slots
        self._releases = 0
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Requests waiting for KV slots that running requests hold."""
        return self._waiting

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the engine alone (turns are granted in arrival order), on its pinned thread count. The
        count is torch's process-wide setting and stays set (changing it rebuilds a thread pool, which
        costs milliseconds); it is checked per turn because OpenMP and MKL keep it per calling thread."""
        with self._turns.held():
            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            yield

    def serve(self, request: ChatRequest, on_token: OnToken | None) -> Generation:
        """:meth:`prepare` then :meth:`generate`, taking turns with other requests."""
        with self.turn():
            prepared = self.prepare(request)
        return self.generate(prepared, request, on_token)

    def prepare(self, request: ChatRequest) -> Prepared:
        """Render and compile; every problem with the request raises :class:`RequestError`."""
        messages = list(request.messages)
        try:
            source = template_for(request.rules, self.files.chat_template)
            template = self.template if source == self.files.chat_template else chat_template(source)
            tools = list(request.tools) or None
            owned = template.render_owned(messages, tools=tools, add_generation_prompt=True, **request.template_kwargs)
            provenance = token_provenance(owned, self.files.tokenizer)
            program = compile_rules(provenance, messages, request.rules, lambda variant: template.render(
                variant, tools=tools, add_generation_prompt=True, **request.template_kwargs))
        except SpanError as exc:
            raise RequestError("drop_rule", _type_of(request), f"cannot place the drop_rule: {exc}") from exc
        except ProgramError as exc:
            raise RequestError("messages", f"{len(messages)} messages", f"cannot compile the request: {exc}") from exc
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:  # input the template cannot take
            raise RequestError("messages", f"{len(messages)} messages",
                               f"the chat template cannot render them: {exc}") from exc
        problem = live_length_problem(program, None, self.max_context)
        if problem is not None:
            raise RequestError("messages", live_length(program), problem)
        max_new_tokens = min(self.max_context - live_length(program), request.sampling.max_tokens)
        prompt_slots = cold_plan(program).n_slots
        if prompt_slots > self.pool.size:
            raise RequestError("messages", program.n_prompt, f"the prompt needs {prompt_slots} KV slots, more than "
                               f"the {self.pool.size} this server holds (maximum context length)")
        kv_slots = prompt_slots + max_new_tokens - 1  # the last generated token gets no KV
        if kv_slots > self.pool.size:
            field = request.sampling.max_tokens_field
            raise RequestError(field, request.sampling.max_tokens, f"the prompt takes {prompt_slots} of the "
                               f"{self.pool.size} KV slots this server holds, room for at most "
                               f"{self.pool.size - prompt_slots + 1} new tokens")
        return Prepared(program, max_new_tokens, kv_slots)

    def generate(self, prepared: Prepared, request: ChatRequest, on_token: OnToken | None) -> Generation:
        """Run the prompt through the cache plan, then decode; publishes all new KV to the tree. Each step
        is one turn; ``on_token`` is called between turns, so a caller that waits there (a client
        reading slowly) holds up only this request, and one that raises aborts it with everything
        released."""
        program = prepared.program
        active, reserved = self._admit_when_free(program, prepared.max_new_tokens - 1)
        plan = active.plan
        ids: list[int] = []
        steps: list[TokenStep] = []
        used = 0
        finish = "length"
        try:
            with self.turn():
                sampler = Sampler(request.sampling)
                tracker = TextTracker(self.files.tokenizer, request.sampling.stop)
                logits = run_prefill(self.model, program, plan, self.kv, self.prefill_chunk)[program.n_tokens - 1]
                terminal_slots = torch.tensor(plan.terminal.slots, dtype=torch.int64)
            while True:
                with self.turn():
                    step = self._step(logits, sampler)
                    ids.append(step.chosen.token_id)
                    steps.append(step)
                    visible = tracker.update(ids)
                    if step.chosen.token_id in self.files.eos_token_ids or tracker.stopped:
                        finish = "stop"
                    elif len(ids) < prepared.max_new_tokens:
                        used += 1
                        slots = torch.cat((terminal_slots, torch.from_numpy(reserved[:used])))
                        logits = forward_paged(
                            self.model, torch.tensor([ids[-1]]), torch.tensor([program.next_position + used - 1]),
                            self.kv.k, self.kv.v, torch.from_numpy(reserved[used - 1 : used]),
                            torch.tensor([0, slots.numel()]), slots, slot_positions=self.kv.positions,
                        )[0]
                if on_token is not None:
                    on_token(step, visible)
                if finish == "stop" or len(ids) >= prepared.max_new_tokens:
                    break
            with self.turn():
                self.cache.finish(active, np.asarray(ids[:used], dtype=np.int64), reserved[:used])
        except BaseException:
            with self.turn():
                try:
                    self.pool.decref(reserved)
                    self.cache.abort(active)
                finally:
                    self._release_one()
            raise
        with self.turn():
            self.pool.decref(reserved[used:])
            self._release_one()
            text = tracker.final(ids)
        usage = plan.usage
        return Generation(
            token_ids=tuple(ids),
            text=text,
            steps=tuple(steps),
            finish_reason=finish,
            usage=PromptUsage(program.n_prompt, usage.cached_tokens, usage.repos_tokens, usage.drop_skipped_tokens,
                              usage.computed_tokens),
        )

    def _admit_when_free(self, program: ContextProgram, n_decode: int) -> tuple[ActiveRequest, np.ndarray]:
        """:meth:`_admit` in a turn; while the slots it needs are held by requests this engine runs (they
        will finish), wait for one of them to give its slots back instead of refusing."""
        while True:
            with self.turn():
                try:
                    admitted = self._admit(program, n_decode)
                except EngineBusy:
                    if not self._running:
                        raise
                    seen = self._releases
                else:
                    self._running += 1
                    return admitted
            with self._released:
                self._waiting += 1
                try:
                    self._released.wait_for(lambda: self._releases != seen)
                finally:
                    self._waiting -= 1

    def _release_one(self) -> None:
        with self._released:
            self._running -= 1
            self._releases += 1
            self._released.notify_all()

    def _admit(self, program: ContextProgram, n_decode: int) -> tuple[ActiveRequest, np.ndarray]:
        """Admit ``program`` and reserve ``n_decode`` slots for its generated KV. When the pool is short
        after locking the matched prefix, the tree is flushed and the request admitted cold (which
        :meth:`prepare` checked fits an empty pool); :class:`EngineBusy` when other requests hold the rest."""
        try:
            return self._admit_once(program, n_decode)
        except CacheFull:
            self.cache.flush()
        try:
            return self._admit_once(program, n_decode)
        except CacheFull as exc:
            raise EngineBusy(f"the KV pool is held by {self.cache.active} other requests: {exc}") from exc

    def _admit_once(self, program: ContextProgram, n_decode: int) -> tuple[ActiveRequest, np.ndarray]:
        active = self.cache.admit(program)
        try:
            return active, self.cache.allocate(n_decode)
        except BaseException:
            self.cache.abort(active)
            raise

    def _step(self, logits: torch.Tensor, sampler: Sampler) -> TokenStep:
        logits = logits.to(device="cpu", dtype=torch.float32)
        logprobs = torch.log_softmax(logits, dim=-1)
        token = sampler.pick(logits)
        top = torch.topk(logprobs, min(TOP_CANDIDATES, logprobs.numel()))
        return TokenStep(
            chosen=self._choice(token, float(logprobs[token])),
            top=tuple(self._choice(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)),
        )

    def _choice(self, token_id: int, logprob: float) -> TokenChoice:
        return TokenChoice(token_id, self.files.tokenizer.decode([token_id], skip_special_tokens=False), logprob)


def _type_of(request: ChatRequest) -> str:
    return type(request.rules.span).__name__


def _content_format(chat_template: str) -> str:
    """The template's content format, as SGLang detects it (an unparsable template counts as "string")."""
    try:
        parsed = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(chat_template)
    except jinja2.TemplateSyntaxError:
        parsed = None
    return template_content_format(chat_template, parsed)


class _Turns:
    """A lock granted in the order it was asked for (``threading.Lock`` favours the thread that just
    released it, which would let one long request starve the others)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._waiting: deque[object] = deque()
        self._held = False

    @contextmanager
    def held(self) -> Iterator[None]:
        me = object()
        with self._changed:
            self._waiting.append(me)
            try:
                self._changed.wait_for(lambda: not self._held and self._waiting[0] is me)
            except BaseException:
                self._waiting.remove(me)
                self._changed.notify_all()
                raise
            self._waiting.popleft()
            self._held = True
        try:
            yield
        finally:
            with self._changed:
                self._held = False
                self._changed.notify_all()
