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


def parse(body: dict) -> dict:
    try:
        request = protocol.ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
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
