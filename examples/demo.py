"""AKV demo: follow a chain of shipment records with a tool-calling agent whose cache policy drops
old records and repositions, and show what the server reused, re-rotated and dropped.

    python examples/demo.py --base-url http://127.0.0.1:30000 --model NAME --output runs/demo
    python examples/demo.py --model-path models/smollm2 --output runs/demo --scripted   # embedded CPU server

The same as the ``akv-demo`` command (``examples/akv_demo/cli.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from akv_demo.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
