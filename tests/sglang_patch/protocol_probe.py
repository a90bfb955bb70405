"""Parse request bodies and serialize usage objects with an installed sglang (run as a subprocess).

stdin: {"requests": [body, ...], "details": [kwargs, ...]}; stdout (last line): {"requests":
[{"ok", "error", "dump"}], "details": [json text], "version": sglang.__version__}.
"""

from __future__ import annotations

import json
import sys

import cpu_shim

cpu_shim.install()

import sglang
from pydantic import ValidationError
from sglang.srt.entrypoints.openai import protocol

try:
    from akv.system.adapter.protocol import request_rules
except ImportError:  # the stock wheel's probe runs without the AKV package on its path
    request_rules = None


def parse(body: dict) -> dict:
    """Parse as the HTTP layer does, then (AKV build) check the cache operations as the serving
    path does before any model work."""
    try:
        request = protocol.ChatCompletionRequest.model_validate(body)
        if request_rules is not None and sglang.__version__.endswith("+akv"):
            request_rules(request)
    except (ValidationError, ValueError) as exc:
        return {"ok": False, "error": str(exc), "dump": None}
    return {"ok": True, "error": None, "dump": request.model_dump(mode="json")}


def main() -> None:
    payload = json.load(sys.stdin)
    out = {
        "version": sglang.__version__,
        "requests": [parse(body) for body in payload.get("requests", [])],
        "details": [
            protocol.UsageInfo(prompt_tokens=7, total_tokens=9, completion_tokens=2,
                               prompt_tokens_details=protocol.PromptTokensDetails(**kwargs)).model_dump_json()
            for kwargs in payload.get("details", [])
        ],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
