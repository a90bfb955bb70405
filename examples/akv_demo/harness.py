"""The agent loop: an OpenAI tool-calling loop with a CachePolicy applied before every call.

With ``scripted`` the harness picks each tool call itself (following the chain, and in the
model-driven policy also calling ``drop_context``), but every step still goes to the server and the
model's own reply is generated and recorded; without it the model's tool calls drive the loop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from akv.agent import CacheOperationHistory, TokenCounter, send_chat_request
from akv_demo.artifacts import RunArtifacts
from akv_demo.plot import write_svg
from akv_demo.policies import DemoPolicy, make_counter, make_policy
from akv_demo.records import TOOL_NAME, ShipmentChain, read_record_schema, run_read_record
from akv_demo.report import StepRecord, column_meanings, step_line, summary_table, totals

SYSTEM_PROMPT = ("You are a logistics assistant. Use the read_record tool to follow a shipment's records "
                 "one by one until a record states the final destination, then answer with it.")


@dataclass(frozen=True)
class DemoConfig:
    """One run: where to send requests, which policy, and how long the record chain is."""

    base_url: str
    model: str
    output: Path
    policy: str = "turn"
    scripted: bool = False
    steps: int = 6
    manifest_lines: int = 12
    max_tokens: int = 48
    temperature: float = 0.0
    seed: int = 7
    timeout_s: float = 600.0
    tokenizer_dir: Path | None = None


@dataclass(frozen=True)
class DemoResult:
    """What happened: per-step records, whether the chain was followed to its end, the final answer."""

    records: tuple[StepRecord, ...]
    records_read: tuple[str, ...]
    chain_completed: bool
    final_answer: str | None
    output: Path


class _Conversation:
    """The growing message list plus what the harness knows about it."""

    def __init__(self, chain: ShipmentChain) -> None:
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Where did shipment {chain.shipment} end up? Start with record "
                                        f"{chain.first_id}."},
        ]
        self.record_messages: list[int] = []
        self.drop_requested: set[int] = set()
        self.records_read: list[str] = []


def run_demo(config: DemoConfig, log: Callable[[str], None] = print) -> DemoResult:
    """Run the loop until the final answer (or ``steps + 2`` calls), writing artifacts as it goes."""
    artifacts = RunArtifacts(config.output)
    chain = ShipmentChain.generate(config.steps, manifest_lines=config.manifest_lines, seed=config.seed)
    counter = make_counter(config.tokenizer_dir) if config.policy == "token" else None
    record_size = record_tokens(chain, counter) if counter else len(chain.read(chain.first_id)) // 4
    demo = make_policy(config.policy, record_tokens=record_size, counter=counter)
    tools = [read_record_schema()] + ([demo.drop_tool.schema()] if demo.drop_tool else [])
    artifacts.write("run.json", {
        "base_url": config.base_url, "model": config.model, "policy": config.policy,
        "policy_description": demo.description, "scripted": config.scripted, "chain_length": config.steps,
        "shipment": chain.shipment, "record_ids": list(chain.ids), "max_tokens": config.max_tokens,
        "temperature": config.temperature,
    })
    log(f"AKV demo: policy={config.policy} ({demo.description}); scripted={config.scripted}; "
        f"{config.steps} records; server {config.base_url} model {config.model}")

    convo = _Conversation(chain)
    history: CacheOperationHistory | None = None
    records: list[StepRecord] = []
    final_answer: str | None = None
    for step in range(1, config.steps + 3):
        payload = {"model": config.model, "messages": convo.messages, "tools": tools,
                   "max_tokens": config.max_tokens, "temperature": config.temperature, "stream": True}
        sent, history = demo.policy.process(payload, history)
        artifacts.write_step(step, "payload_before", payload)
        artifacts.write_step(step, "payload_after", sent)
        artifacts.write_step(step, "history", json.loads(history.to_json()))
        log(f"[step {step:2d}] sending {len(sent['messages'])} messages; drop_message="
            f"{sent.get('drop_message', {})} reposition={sent.get('reposition', [])}")
        started = time.perf_counter()
        result = send_chat_request(config.base_url, sent, trace=artifacts.trace_dir(step), timeout=config.timeout_s)
        latency = time.perf_counter() - started
        reply = result.as_message()
        artifacts.write_step(step, "reply", {"message": reply, "finish_reason": result.finish_reason,
                                             "ttft_s": result.timings.ttft_s, "tpot_s": result.timings.tpot_s})
        usage = dict(result.usage.raw) if result.usage is not None else None
        artifacts.write_step(step, "usage", usage)

        assistant, answer = _next_assistant_message(config, chain, convo, demo, reply)
        action, results = _act(assistant, chain, convo, demo, history)
        artifacts.write_step(step, "action", {"assistant": assistant, "tool_results": results, "summary": action})
        record = StepRecord.from_usage(step, len(sent["messages"]), usage, latency, len(history.hidden),
                                       len(history.reposition()), action)
        records.append(record)
        log(step_line(record))
        if answer is not None:
            final_answer = answer
            break

    completed = tuple(convo.records_read) == chain.ids and final_answer is not None \
        and chain.final_location in final_answer
    table = summary_table(records)
    (config.output / "summary.txt").write_text(f"{table}\n\nColumns:\n{column_meanings()}\n", encoding="utf-8")
    artifacts.write("summary.json", {
        "chain_completed": completed, "final_answer": final_answer, "final_location": chain.final_location,
        "records_read": convo.records_read, "steps": [r.as_dict() for r in records], "totals": totals(records),
        "history": json.loads(history.to_json()) if history is not None else None,
    })
    write_svg(records, config.output / "plot.svg", f"AKV demo, policy={config.policy}")
    log(table)
    log(f"chain completed: {completed}; final answer: {final_answer!r}; artifacts in {config.output}")
    return DemoResult(tuple(records), tuple(convo.records_read), completed, final_answer, config.output)


def record_tokens(chain: ShipmentChain, counter: TokenCounter) -> int:
    """Tokens of the first record as the tool result of the first step, counted in that conversation
    (templates such as Qwen3's refuse to render a tool message without a user query before it)."""
    messages = _Conversation(chain).messages
    call = _call(len(messages), 0, TOOL_NAME, {"record_id": chain.first_id})
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": chain.read(chain.first_id)}]
    return counter.layout(messages).message_tokens[-1]


def _next_assistant_message(config: DemoConfig, chain: ShipmentChain, convo: _Conversation, demo: DemoPolicy,
                            reply: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The assistant message to append and, when it ends the run, the final answer."""
    if not config.scripted:
        if reply.get("tool_calls"):
            return reply, None
        return reply, reply.get("content") or ""
    last = convo.records_read[-1] if convo.records_read else None
    if last is not None and chain.next_id(last) is None:
        answer = f"Shipment {chain.shipment} ended up at {chain.final_location}."
        return {"role": "assistant", "content": answer}, answer
    target = chain.first_id if last is None else chain.next_id(last)
    calls = [_call(len(convo.messages), 0, TOOL_NAME, {"record_id": target})]
    stale = [i for i in convo.record_messages[:-1] if i not in convo.drop_requested]
    if demo.drop_tool is not None and stale:
        calls.append(_call(len(convo.messages), 1, demo.drop_tool.name,
                           {"message_ids": stale, "reason": "records already followed"}))
    return {"role": "assistant", "content": None, "tool_calls": calls}, None


def _call(message_id: int, index: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{message_id}_{index}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _act(assistant: dict[str, Any], chain: ShipmentChain, convo: _Conversation, demo: DemoPolicy,
         history: CacheOperationHistory) -> tuple[str, list[dict[str, Any]]]:
    """Append ``assistant``, run its tool calls locally and append their results; return a one-line
    description and the tool messages."""
    convo.messages.append(assistant)
    calls = assistant.get("tool_calls") or []
    if not calls:
        return "final answer", []
    done = []
    results = []
    for call in calls:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        if demo.drop_tool is not None and name == demo.drop_tool.name:
            receipt = demo.drop_tool.execute(arguments, convo.messages, history)
            content = json.dumps(receipt)
            if receipt.get("status") == "scheduled":
                convo.drop_requested.update(receipt["message_ids"])
            done.append(f"{name}({receipt.get('message_ids', receipt.get('error'))})")
        elif name == TOOL_NAME:
            content = run_read_record(chain, arguments)
            record_id = _record_id(arguments)
            if not content.startswith("error:") and record_id is not None:
                convo.records_read.append(record_id)
                convo.record_messages.append(len(convo.messages))
            done.append(f"{name}({record_id})")
        else:
            content = f"error: unknown tool {name!r}"
            done.append(f"{name}(unknown)")
        result = {"role": "tool", "tool_call_id": call["id"], "content": content}
        convo.messages.append(result)
        results.append(result)
    return " + ".join(done), results


def _record_id(arguments: str | dict[str, Any]) -> str | None:
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return None
    value = parsed.get("record_id") if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else None
