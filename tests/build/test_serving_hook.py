"""The serving_chat hook: which context requests are admitted, and that plain ones are never checked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from akv.system.adapter.serving import UnsupportedContextRequest, prepare_context_request
from akv.system.context.rules import ContextRules, Drop

MESSAGES = [{"role": "user", "content": str(i)} for i in range(4)]
GOOD_SERVER = dict(page_size=1, attention_backend="triton", prefill_attention_backend=None,
                   decode_attention_backend=None)


def _serving(chat_template_name: str | None = None, **server: object) -> SimpleNamespace:
    return SimpleNamespace(
        template_manager=SimpleNamespace(chat_template_name=chat_template_name),
        tokenizer_manager=SimpleNamespace(server_args=SimpleNamespace(**{**GOOD_SERVER, **server})),
    )


def _request(**fields: object) -> SimpleNamespace:
    base = dict(messages=MESSAGES, drop_message=None, reposition=None, n=1, input_ids=None,
                continue_final_message=False)
    return SimpleNamespace(**{**base, **fields})


def test_context_request_yields_its_rules() -> None:
    rules = prepare_context_request(_serving(), _request(drop_message={"2": [0, 1]}, reposition=[2, 3]), False)
    assert rules == ContextRules(drops=(Drop(anchor=2, messages=(0, 1)),), repositions=(2, 3))


@pytest.mark.parametrize("drop_message", [None, {}])
def test_plain_request_is_not_checked_even_on_an_unsupported_setup(drop_message: object) -> None:
    serving = _serving("chatml", page_size=16, attention_backend="fa3")
    request = _request(drop_message=drop_message, n=3, input_ids=[1, 2], continue_final_message=True)
    assert prepare_context_request(serving, request, True) is None


@pytest.mark.parametrize(
    ("request_fields", "multimodal", "message"),
    [
        ({"n": 2}, False, "n: drop_message/reposition need n == 1, got 2"),
        ({"input_ids": [5, 6]}, False, "input_ids: "),
        ({"continue_final_message": True}, False, "continue_final_message: "),
        ({}, True, "model: drop_message/reposition are not supported for multimodal models"),
    ],
)
def test_unsupported_request_modes_are_refused(request_fields: dict, multimodal: bool, message: str) -> None:
    with pytest.raises(UnsupportedContextRequest, match=message):
        prepare_context_request(_serving(), _request(reposition=[1], **request_fields), multimodal)


@pytest.mark.parametrize(
    ("template", "server", "message"),
    [
        ("chatml", {}, "chat_template: the built-in template 'chatml'"),
        (None, {"page_size": 16}, "server configuration: page_size 16"),
        (None, {"attention_backend": "flashinfer"}, "server configuration: attention_backend 'flashinfer'"),
        (None, {"decode_attention_backend": "fa3"}, "server configuration: decode_attention_backend 'fa3'"),
        (None, {"prefill_attention_backend": "fa3"}, "server configuration: prefill_attention_backend 'fa3'"),
    ],
)
def test_unsupported_server_setups_are_refused(template: str | None, server: dict, message: str) -> None:
    with pytest.raises(UnsupportedContextRequest, match=message):
        prepare_context_request(_serving(template, **server), _request(drop_message={"1": [0]}), False)


def test_refusals_are_value_errors_so_sglang_answers_400() -> None:
    assert issubclass(UnsupportedContextRequest, ValueError)
