"""A deterministic chain of shipment records and the local ``read_record`` tool that serves them.

Record ``k`` is a long manifest that names the id of record ``k + 1``; the last record names the
final location instead. Everything derives from ``seed``, so runs are reproducible.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

TOOL_NAME = "read_record"
_CITIES = ("Rotterdam", "Singapore", "Busan", "Valencia", "Antwerp", "Santos", "Durban", "Halifax",
           "Gdansk", "Mombasa", "Callao", "Tacoma", "Piraeus", "Colombo", "Manzanillo", "Tangier")
_GOODS = ("ball bearings", "coffee beans", "solar panels", "wool bales", "copper wire", "ceramic tiles",
          "bicycle frames", "olive oil", "printer paper", "glass jars", "cotton yarn", "tin cans")
_CARRIERS = ("Northwind Lines", "Blue Heron Freight", "Kestrel Shipping", "Meridian Cargo")


class ToolError(ValueError):
    """A ``read_record`` call named a record id that is not in the chain."""


@dataclass(frozen=True)
class ShipmentChain:
    """``length`` records; ``ids[k]`` is record k's id, ``final_location`` what the last one reveals."""

    shipment: str
    ids: tuple[str, ...]
    final_location: str
    manifest_lines: int
    seed: int

    @classmethod
    def generate(cls, length: int, *, manifest_lines: int = 12, seed: int = 7) -> ShipmentChain:
        if type(length) is not int or length < 1:
            raise ValueError(f"length must be a positive int, got {length!r}")
        if type(manifest_lines) is not int or manifest_lines < 1:
            raise ValueError(f"manifest_lines must be a positive int, got {manifest_lines!r}")
        rng = random.Random(seed)
        ids: list[str] = []
        while len(ids) < length:
            candidate = f"R-{rng.randrange(1000, 9999)}"
            if candidate not in ids:
                ids.append(candidate)
        return cls(
            shipment=f"SHP-{rng.randrange(10000, 99999)}",
            ids=tuple(ids),
            final_location=f"Warehouse {rng.randrange(1, 40)}, {rng.choice(_CITIES)}",
            manifest_lines=manifest_lines,
            seed=seed,
        )

    @property
    def first_id(self) -> str:
        return self.ids[0]

    def next_id(self, record_id: str) -> str | None:
        """The id record ``record_id`` points to; None for the last record."""
        k = self._index(record_id)
        return self.ids[k + 1] if k + 1 < len(self.ids) else None

    def read(self, record_id: str) -> str:
        """The full text of one record."""
        k = self._index(record_id)
        rng = random.Random(f"{self.seed}/{record_id}")
        lines = [f"RECORD {record_id} (shipment {self.shipment}, leg {k + 1})",
                 f"Carrier: {rng.choice(_CARRIERS)}; vessel voyage {rng.randrange(100, 999)}W",
                 "Manifest:"]
        for line in range(self.manifest_lines):
            lines.append(f"  {line + 1:02d}. {rng.randrange(2, 90)} pallets of {rng.choice(_GOODS)}, "
                         f"{rng.randrange(100, 2000)} kg, seal {rng.randrange(10**5, 10**6)}, "
                         f"inspected at {rng.choice(_CITIES)}")
        following = self.next_id(record_id)
        if following is None:
            lines.append(f"FINAL DESTINATION: {self.final_location}. This is the last record.")
        else:
            lines.append(f"Transferred onward; continue with record {following}.")
        return "\n".join(lines)

    def _index(self, record_id: str) -> int:
        try:
            return self.ids.index(record_id)
        except ValueError:
            raise ToolError(f"record_id {record_id!r} does not exist") from None


def read_record_schema() -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Read one shipment record by id. Each record names the next record to read, "
                           "or the final destination.",
            "parameters": {
                "type": "object",
                "properties": {"record_id": {"type": "string", "description": "a record id such as R-1234"}},
                "required": ["record_id"],
            },
        },
    }


def run_read_record(chain: ShipmentChain, arguments: str | dict[str, Any]) -> str:
    """Execute a ``read_record`` call; errors come back as text the model can read."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return f"error: arguments are not valid JSON: {arguments!r}"
    record_id = parsed.get("record_id") if isinstance(parsed, dict) else None
    if not isinstance(record_id, str):
        return f"error: record_id must be a string, got {record_id!r}"
    try:
        return chain.read(record_id)
    except ToolError as exc:
        return f"error: {exc}"
