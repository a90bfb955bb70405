"""akv.agent: the client policy library of AKV (standard library only).

Read the final chat payload, decide which earlier messages the model should stop attending to
(drop) and when to compact positions (reposition), and add those decisions to the payload."""

from akv.agent.budget import LiveBudgetSelection, LiveBudgetTrigger, live_budget_policy
from akv.agent.context import DecisionContext
from akv.agent.counting import ApproximateTokenCounter, TokenCounter, TokenLayout
from akv.agent.errors import (
                              AKVError,
                              BackendError,
                              ConfigError,
                              ContextLengthError,
                              HistoryError,
                              HTTPStatusError,
                              IncompleteStreamError,
                              MissingExtraError,
                              PayloadError,
                              RedirectError,
                              RuleError,
                              StreamError,
                              TokenCountError,
                              TransportError,
                              UnexpectedResponseError,
)
from akv.agent.history import CacheOperation, CacheOperationHistory
from akv.agent.keep_text import keep_text_payload
from akv.agent.openai import extra_body
from akv.agent.policy import CachePolicy
from akv.agent.protection import Protection
from akv.agent.receipts import ModelRequest
from akv.agent.reposition import ModelReposition, TokenReposition, TurnReposition
from akv.agent.results import GenerationResult, Timings, ToolCall, Usage
from akv.agent.routing import ROUTING_HEADER, routing_key
from akv.agent.selectors import ModelSelection, ResultSelection, TokenSelection, TurnSelection
from akv.agent.templating import TemplateInputError, TemplateInputs, sglang_template_inputs
from akv.agent.tool import DropContextTool
from akv.agent.transport import send_chat_request
from akv.agent.triggers import ModelTrigger, ResultTrigger, TokenTrigger, TurnTrigger

__all__ = [
    "AKVError", "ApproximateTokenCounter", "BackendError", "CacheOperation", "CacheOperationHistory",
    "CachePolicy", "ConfigError", "ContextLengthError", "DecisionContext", "DropContextTool", "GenerationResult",
    "HistoryError", "HTTPStatusError", "IncompleteStreamError", "LiveBudgetSelection", "LiveBudgetTrigger",
    "MissingExtraError", "ModelReposition", "ModelRequest",
    "ModelSelection", "ModelTrigger", "PayloadError", "Protection", "RedirectError", "ResultSelection",
    "ResultTrigger", "ROUTING_HEADER", "RuleError",
    "StreamError",
    "TemplateInputError", "TemplateInputs", "Timings", "TokenCountError", "TokenCounter", "TokenLayout",
    "TokenReposition", "TokenSelection", "TokenTrigger", "ToolCall", "TransportError", "TurnReposition",
    "TurnSelection", "TurnTrigger", "UnexpectedResponseError", "Usage", "extra_body", "keep_text_payload",
    "live_budget_policy", "routing_key", "send_chat_request",
    "sglang_template_inputs",
]
