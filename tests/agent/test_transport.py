"""send_chat_request against a local http.server: assembly, every byte split, errors, traces."""

from __future__ import annotations

import json

import pytest

from akv.agent import (
    ConfigError,
    ContextLengthError,
    HTTPStatusError,
    IncompleteStreamError,
    PayloadError,
    RedirectError,
    StreamError,
    TransportError,
    UnexpectedResponseError,
)
from akv.agent.results import ToolCall
from akv.agent.sse import SSEParser
from akv.agent.transport import chat_completions_url, send_chat_request

from .sse_server import Script, serve

PAYLOAD = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "drop_message": {"4": [2]}}


def chunk(delta=None, finish=None, usage=None, **extra) -> dict:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    if usage is not None:
        body["usage"] = usage
    return body


USAGE = {"prompt_tokens": 120, "completion_tokens": 9, "total_tokens": 129,
         "prompt_tokens_details": {"cached_tokens": 80, "repos_tokens": 30, "drop_skipped_tokens": 12}}
EVENTS = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "th"}),
    chunk({"reasoning_content": "ink"}),
    chunk({"content": "Héllo "}),
    chunk({"content": "😀 world"}),
    chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                           "function": {"name": "read_record", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                           "function": {"name": "search", "arguments": "{\"q\""}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"id\": "}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"A\"}"}}]}),
    chunk({"tool_calls": [{"index": 1, "function": {"arguments": ": \"x\"}"}}]}),
    chunk({}, finish="tool_calls"),
    chunk(usage=USAGE),
]


def sse(events, *, newline: str = "\n", done: bool = True) -> bytes:
    text = "".join(f"data: {json.dumps(e, ensure_ascii=False)}{newline}{newline}" for e in events)
    text = ": keep-alive comment" + newline + text
    if done:
        text += f"data: [DONE]{newline}{newline}"
    return text.encode("utf-8")


def check_result(result) -> None:
    assert result.content == "Héllo 😀 world"
    assert result.reasoning_content == "think"
    assert result.tool_calls == (ToolCall("call_a", "read_record", '{"id": "A"}'),
                                 ToolCall("call_b", "search", '{"q": "x"}'))
    assert result.finish_reason == "tool_calls"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (120, 9)
    assert (result.usage.cached_tokens, result.usage.repos_tokens, result.usage.drop_skipped_tokens) == (80, 30, 12)
    assert result.response_id == "chatcmpl-1"
    assert result.as_message()["tool_calls"][1]["function"] == {"name": "search", "arguments": '{"q": "x"}'}


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_stream_assembles_over_http(newline):
    script = Script(pieces=[sse(EVENTS, newline=newline)])
    with serve(script) as url:
        result = send_chat_request(url, PAYLOAD, headers={"Authorization": "Bearer secret"})
    check_result(result)
    sent = script.requests[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["drop_message"] == {"4": [2]} and sent["messages"] == PAYLOAD["messages"]
    assert script.headers[0]["Authorization"] == "Bearer secret"
    assert result.timings.ttft_s is not None and result.timings.total_s >= result.timings.ttft_s


@pytest.mark.parametrize("newline", ["\r\n", "\r"])
def test_stream_split_at_every_byte_boundary(newline):
    body = sse(EVENTS, newline=newline)
    script = Script()
    with serve(script) as url:
        for k in range(len(body) + 1):
            script.pieces = [body[:k], body[k:]]
            check_result(send_chat_request(url, PAYLOAD))
        script.pieces = [body[i:i + 1] for i in range(len(body))]
        check_result(send_chat_request(url, PAYLOAD))


def test_parser_every_split_without_http():
    body = b"\xef\xbb\xbf" + sse(EVENTS[:5], newline="\r\n")
    whole = SSEParser()
    expected = whole.feed(body) + whole.close()
    assert len(expected) == 6 and expected[-1].data == "[DONE]"
    for k in range(len(body) + 1):
        parser = SSEParser()
        assert parser.feed(body[:k]) + parser.feed(body[k:]) + parser.close() == expected


def test_multiline_data_and_event_names():
    parser = SSEParser()
    events = parser.feed(b"event: error\ndata: a\ndata:b\nid: 7\n\ndata: c") + parser.close()
    assert [(e.event, e.data) for e in events] == [("error", "a\nb"), (None, "c")]


def test_stream_without_done_raises():
    with serve(Script(pieces=[sse(EVENTS, done=False)])) as url:
        with pytest.raises(IncompleteStreamError, match="ended before \\[DONE\\]"):
            send_chat_request(url, PAYLOAD)


def test_error_event_raises_with_body():
    error = {"error": {"message": "scheduler aborted the request", "code": 503}}
    with serve(Script(pieces=[sse(EVENTS[:3] + [error])])) as url:
        with pytest.raises(StreamError, match="scheduler aborted") as info:
            send_chat_request(url, PAYLOAD)
    assert info.value.status == 503 and "scheduler aborted" in info.value.body


def test_context_length_error_event():
    error = {"object": "error", "message": "occurrence position exceeds the model's maximum context length"}
    with serve(Script(pieces=[sse([error])])) as url:
        with pytest.raises(ContextLengthError):
            send_chat_request(url, PAYLOAD)


@pytest.mark.parametrize("bad, match", [
    ({"choices": "abc"}, "choices must be a list"),
    ({"choices": [{"index": 0, "delta": "x"}]}, "delta must be an object"),
    ({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": "f"}]}}]}, "function"),
    ({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": "a", "function": {"name": "f"}}]}}]}, "index"),
    ({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 3}}]}}]},
     "function.arguments must be a string"),
    ({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": 5, "function": {}}]}}]},
     "id must be a string"),
])
def test_malformed_chunks_are_stream_errors(bad, match):
    with serve(Script(pieces=[sse(EVENTS[:2] + [bad])])) as url:
        with pytest.raises(StreamError, match=match) as info:
            send_chat_request(url, PAYLOAD)
    assert json.loads(info.value.body) == bad


def test_invalid_utf8_in_stream():
    with serve(Script(pieces=[b"data: \xff\xfe\n\n"])) as url:
        with pytest.raises(StreamError, match="not valid UTF-8"):
            send_chat_request(url, PAYLOAD)


@pytest.mark.parametrize("status, body, kind", [
    (400, '{"object": "error", "message": "drop_message: message id 9 is in the future of anchor 4"}',
     HTTPStatusError),
    (500, "Internal Server Error", HTTPStatusError),
    (400, '{"object": "error", "message": "The input (5000 tokens) is longer than the model\'s context length '
          '(4096 tokens)."}', ContextLengthError),
])
def test_http_errors_carry_status_and_body(status, body, kind):
    with serve(Script(status=status, pieces=[body.encode()], content_type="application/json")) as url:
        with pytest.raises(kind) as info:
            send_chat_request(url, PAYLOAD)
    assert info.value.status == status and info.value.body == body
    assert not isinstance(info.value, HTTPStatusError) or kind is HTTPStatusError


def test_connection_refused_is_a_transport_error():
    with serve(Script()) as url:
        pass
    with pytest.raises(TransportError):
        send_chat_request(url, PAYLOAD, timeout=2)


DEEP: list = []
_inner = DEEP
for _ in range(100_000):
    _inner.append([])
    _inner = _inner[0]


@pytest.mark.parametrize("base_url, payload, options, error, match", [
    ("http://127.0.0.1:1", {**PAYLOAD, "stream": False}, {}, PayloadError, "streaming-only"),
    ("http://127.0.0.1:1", PAYLOAD, {"timeout": 0}, ConfigError, "timeout must be a positive"),
    (1, PAYLOAD, {}, ConfigError, "base_url must be a string, got int"),
    (["http://h"], PAYLOAD, {}, ConfigError, "base_url must be a string, got list"),
    ("http://127.0.0.1:1", None, {}, PayloadError, "payload must be a mapping, got NoneType"),
    ("http://127.0.0.1:1", [("model", "m")], {}, PayloadError, "payload must be a mapping, got list"),
    ("http://127.0.0.1:1", PAYLOAD, {"headers": "Authorization: x"}, ConfigError, "headers must map strings"),
    ("http://127.0.0.1:1", PAYLOAD, {"headers": {"X-N": 1}}, ConfigError, "headers must map strings"),
    ("http://127.0.0.1:1", {**PAYLOAD, "metadata": object()}, {}, PayloadError, "cannot be sent as JSON"),
    ("http://127.0.0.1:1", {**PAYLOAD, "temperature": float("nan")}, {}, PayloadError, "cannot be sent as JSON"),
    ("http://127.0.0.1:1", {**PAYLOAD, "metadata": DEEP}, {}, PayloadError, "nests too deeply"),
    ("http://127.0.0.1:1", PAYLOAD, {"trace": 7}, ConfigError, "trace must be a path, got int"),
])
def test_argument_checks(base_url, payload, options, error, match):
    with pytest.raises(error, match=match):
        send_chat_request(base_url, payload, **options)


def test_a_stream_cut_mid_event_is_incomplete_and_keeps_the_unfinished_event():
    cut = sse(EVENTS[:3], done=False) + b'data: {"id": "chatcmpl-1", "choices": [{"ind'
    with serve(Script(pieces=[cut])) as url:
        with pytest.raises(IncompleteStreamError, match="middle of an event after 3 events") as info:
            send_chat_request(url, PAYLOAD)
    assert info.value.body == '{"id": "chatcmpl-1", "choices": [{"ind'


def test_a_transfer_cut_short_is_an_incomplete_stream():
    with serve(Script(pieces=[sse(EVENTS[:3], done=False)], end=False)) as url:
        with pytest.raises(IncompleteStreamError, match="closed the stream mid-transfer"):
            send_chat_request(url, PAYLOAD)


def test_a_last_event_without_its_blank_line_still_counts():
    body = sse(EVENTS)[:-2]  # "data: [DONE]" without the blank line that ends it
    with serve(Script(pieces=[body])) as url:
        check_result(send_chat_request(url, PAYLOAD))


@pytest.mark.parametrize("content_type", ["application/json", "text/html; charset=utf-8", None])
def test_a_success_status_without_an_event_stream_keeps_the_body(content_type, tmp_path):
    body = '{"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"message": {"content": "hi"}}]}'
    with serve(Script(pieces=[body.encode()], content_type=content_type)) as url:
        with pytest.raises(UnexpectedResponseError, match="is not an SSE stream") as info:
            send_chat_request(url, PAYLOAD, trace=tmp_path / "t")
    assert info.value.status == 200 and info.value.body == body
    assert (tmp_path / "t" / "response.sse").read_text() == body


def test_a_redirect_is_not_followed_and_says_where_it_pointed():
    script = Script(status=307, pieces=[b"moved"], content_type="text/plain",
                    extra_headers={"Location": "http://elsewhere:8000/v1/chat/completions"})
    with serve(script) as url:
        with pytest.raises(RedirectError, match="redirected to 'http://elsewhere:8000") as info:
            send_chat_request(url, PAYLOAD)
    assert (info.value.status, info.value.body, info.value.location) == (307, "moved",
                                                                         "http://elsewhere:8000/v1/chat/completions")
    assert isinstance(info.value, HTTPStatusError) and len(script.requests) == 1


def test_an_existing_trace_folder_is_refused_before_anything_is_sent(tmp_path):
    (tmp_path / "t").mkdir()
    script = Script(pieces=[sse(EVENTS)])
    with serve(script) as url:
        with pytest.raises(ConfigError, match="already exists"):
            send_chat_request(url, PAYLOAD, trace=tmp_path / "t")
    assert script.requests == [] and list((tmp_path / "t").iterdir()) == []


def test_a_deeply_nested_event_is_a_stream_error():
    with serve(Script(pieces=[b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n"])) as url:
        with pytest.raises(StreamError, match="nests too deeply"):
            send_chat_request(url, PAYLOAD)



@pytest.mark.parametrize("base, url", [
    ("http://h:1", "http://h:1/v1/chat/completions"),
    ("http://h:1/", "http://h:1/v1/chat/completions"),
    ("http://h:1/v1", "http://h:1/v1/chat/completions"),
    ("https://h/api/v1/chat/completions", "https://h/api/v1/chat/completions"),
])
def test_url_normalisation(base, url):
    assert chat_completions_url(base) == url


@pytest.mark.parametrize("base", ["ftp://h", "http://u:p@h", "http://h/?x=1", "h:1"])
def test_bad_urls(base):
    with pytest.raises(ValueError, match="base_url"):
        chat_completions_url(base)


def test_trace_directory(tmp_path):
    trace = tmp_path / "call-1"
    body = sse(EVENTS)
    with serve(Script(pieces=[body])) as url:
        result = send_chat_request(url, PAYLOAD, headers={"Authorization": "Bearer secret", "X-Other": "kept"},
                                   trace=trace)
        with pytest.raises(ConfigError, match="already exists; a trace is never overwritten"):
            send_chat_request(url, PAYLOAD, trace=trace)
    assert json.loads((trace / "request.json").read_bytes())["drop_message"] == {"4": [2]}
    assert (trace / "response.sse").read_bytes() == body
    events = [json.loads(line) for line in (trace / "events.jsonl").read_text().splitlines()]
    assert len(events) == len(EVENTS) + 1 and events[-1]["data"] == "[DONE]"
    assert [e["output"] for e in events[:6]] == [False, True, True, True, True, True]
    call = json.loads((trace / "call.json").read_text())
    assert call["status"] == "completed"
    assert call["headers"]["Authorization"] == "<redacted>" and call["headers"]["X-Other"] == "kept"
    assert call["timings"]["ttft_s"] == result.timings.ttft_s
    assert "secret" not in (trace / "call.json").read_text()
    assert (trace / "call.json").stat().st_mode & 0o777 == 0o600


def test_trace_of_a_failed_call(tmp_path):
    with serve(Script(status=500, pieces=[b"boom"], content_type="text/plain")) as url:
        with pytest.raises(HTTPStatusError):
            send_chat_request(url, PAYLOAD, trace=tmp_path / "t")
    call = json.loads((tmp_path / "t" / "call.json").read_text())
    assert call["status"] == "failed"
    assert call["error"] == {"type": "HTTPStatusError", "message": call["error"]["message"], "http_status": 500,
                             "body": "boom"}
    assert (tmp_path / "t" / "response.sse").read_bytes() == b"boom"
