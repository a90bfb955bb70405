"""Model directories the servers and tests load: SmolLM2-135M-Instruct converted from its GGUF, and
tiny random-weight models."""
