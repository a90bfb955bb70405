"""Model directories the servers and tests load: SmolLM2-135M-Instruct converted from its GGUF,
tiny random-weight models, and gpt-oss (tiny random weights, or the 20b / 120b shapes as config only)."""
