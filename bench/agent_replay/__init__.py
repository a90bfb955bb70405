"""Agent-trajectory benchmarks (issue 13): synthetic and recorded trajectories, an offline policy
cost simulator over the cache core, and a serving replay against an OpenAI-compatible server.

Run from the repository root: `python bench/simulate.py ...`, `python bench/serve_replay.py ...`."""
