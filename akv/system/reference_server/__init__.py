"""A CPU reference server for AKV: OpenAI-compatible chat completions with ``drop_message`` and
``reposition``, executed exactly by the reference model and the cache core. A reference for tests
and demos, not a production server: requests take turns token by token, in FP32, on the CPU."""

from akv.system.reference_server.engine import Engine, EngineBusy, Generation, Prepared
from akv.system.reference_server.protocol import ChatRequest, RequestError, parse_chat_request
from akv.system.reference_server.server import ReferenceServer

__all__ = ["ChatRequest", "Engine", "EngineBusy", "Generation", "Prepared", "ReferenceServer", "RequestError",
           "parse_chat_request"]
