"""Length limits of a context request (DESIGN §2): what a request holds is its *live length*, the
positions its prompt uses after drops and repositions (``ContextProgram.next_position``), plus the
tokens it may generate; its text may be longer than the model's context length. No position may
reach the context length, while the prompt is computed either (a token computed before a later
Repos compacts it still had its birth position).

Both servers word their refusals with :func:`live_length_problem`, so a client sees one message.
"""

from __future__ import annotations

from akv.system.context.program import ContextProgram


def live_length(program: ContextProgram) -> int:
    """Positions the prompt uses: the position the first generated token gets."""
    return int(program.next_position)


def peak_length(program: ContextProgram) -> int:
    """Positions the prompt uses while it is computed: its largest birth position plus one (at
    least the live length)."""
    births = program.birth_position
    return max(live_length(program), int(births.max()) + 1 if births.size else 0)


def live_length_problem(program: ContextProgram, max_new_tokens: int | None, context_length: int) -> str | None:
    """Why ``program`` with ``max_new_tokens`` (None: unbounded, at least one token) does not fit
    ``context_length`` positions, naming the live length, the limit and how many tokens to drop;
    None when it fits."""
    live = live_length(program)
    new = 1 if max_new_tokens is None else max(int(max_new_tokens), 1)
    asked = "" if max_new_tokens is None else f" plus max_tokens {int(max_new_tokens)}"
    text = f"positions after drops and repositions; the text has {program.n_tokens} tokens"
    if live + new > context_length:
        return (f"the live length is {live} tokens ({text}){asked}, more than this model's maximum context "
                f"length of {context_length} tokens: drop (and reposition) at least {live + new - context_length} "
                "more tokens" + ("" if max_new_tokens is None else " or lower max_tokens"))
    peak = peak_length(program)
    if peak > context_length:
        return (f"the live length is {live} tokens ({text}), but computing the prompt reaches position "
                f"{peak - 1}, beyond this model's maximum context length of {context_length} tokens: drop and "
                f"reposition at least {peak - context_length} tokens before the message that reaches it")
    return None
