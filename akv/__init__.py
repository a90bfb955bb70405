"""AKV: agent-managed KV cache. `akv.agent` is the client policy library, `akv.system` the server."""

__version__ = "0.1.0"
