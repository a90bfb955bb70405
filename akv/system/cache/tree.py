"""Radix tree over record keys (tokens and cache events) whose token records carry KV versions.

Each node stores, per record of its edge, up to ``width`` versions (slot, position); event records
and missing KV hold -1. The tree takes one pool reference per version it adopts and gives it back
on eviction.

Eviction is drop-aware. A *path* is a root-to-leaf path whose end a publication recorded (the
leaf keeps that publication's terminal: the position each token is read at from the end, -1 when
dropped). Versions of a token every path drops go first (vacuously so when no recorded path passes
through), then *stale* versions no path reads (positions superseded by a Repos on every path that
keeps the token), then LRU leaves, then LRU inner versions. Evicting a version leaves a hole: the
structure stays, so the path still matches and a later request recomputes only what it must. Only
versions no request references are released.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from akv.system.arrays import frozen
from akv.system.cache.keys import RecordKey
from akv.system.cache.plan import MatchResult
from akv.system.cache.pool import SlotPool

_EMPTY = -1


class TreeError(ValueError):
    """Arguments to a tree operation are inconsistent; the message names the field and value."""


DROPPED, STALE = 0, 1
"""Eviction ranks before the LRU leaves: versions of tokens every path drops, versions no path reads."""


class TreeNode:
    """One edge: ``key`` records with ``slots``/``positions`` arrays of shape (len, width);
    ``terminal``: the terminal (per token of the whole path) of the publication that ended here."""

    __slots__ = ("key", "slots", "positions", "terminal", "children", "parent", "last_access", "uid")

    def __init__(self, key: np.ndarray, slots: np.ndarray, positions: np.ndarray, uid: int) -> None:
        self.key = key
        self.slots = slots
        self.positions = positions
        self.terminal: np.ndarray | None = None
        self.children: dict[int, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.last_access = 0
        self.uid = uid

    @property
    def attached(self) -> bool:
        return self.parent is not None

    def has_versions(self) -> bool:
        return bool((self.slots >= 0).any())


class RadixTree:
    """Match, insert (split as needed), drop-aware eviction and flush over one slot pool."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self._uids = itertools.count()
        self._roots: dict[str, TreeNode] = {}
        self._clock = 0
        self._n_nodes = 0
        self._leaves: list[tuple[int, int, TreeNode]] = []
        self._ranked: list[list[tuple[TreeNode, np.ndarray]]] | None = None
        self.epoch = 0

    @property
    def n_nodes(self) -> int:
        return self._n_nodes

    def stats(self) -> dict[str, int]:
        """Nodes, token records (events excluded) and resident versions held."""
        nodes = self._nodes()
        return {
            "nodes": len(nodes),
            "token_records": sum(int((n.key >= 0).sum()) for n in nodes),
            "versions": sum(int((n.slots >= 0).sum()) for n in nodes),
        }

    def resident_slots(self) -> np.ndarray:
        """Every slot the tree holds a reference to (one entry per version)."""
        parts = [n.slots[n.slots >= 0] for n in self._nodes()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def match(self, key: RecordKey) -> MatchResult:
        """Longest record prefix present in the tree, cut back to whole tokens, with their versions."""
        node = self._root(key.namespace)
        records = key.records
        i = 0
        parts: list[tuple[TreeNode, int]] = []
        stamp = self._tick()
        while i < records.shape[0]:
            child = node.children.get(int(records[i]))
            if child is None:
                break
            common = _common_prefix(child.key, records[i:])
            parts.append((child, common))
            self._touch(child, stamp)
            i += common
            if common < child.key.shape[0]:
                break
            node = child
        n_tokens = key.tokens_within(i)
        slots, positions = _gather(parts, key.token_record[:n_tokens])
        return MatchResult(n_tokens=n_tokens, n_records=i, slots=frozen(slots), positions=frozen(positions))

    def insert(self, key: RecordKey, slots: np.ndarray, positions: np.ndarray, terminal: np.ndarray) -> None:
        """Publish versions for ``key``'s tokens: ``slots[t, j]`` at ``positions[t, j]`` (-1 = none).

        Versions the tree lacks are adopted (the tree takes a reference); duplicates of a resident
        (token, position) are left to the caller. ``terminal[t]`` is the position token ``t`` is read
        at from the end of this path (-1 when dropped); the path's end keeps it to rank eviction.
        """
        n = key.n_tokens
        for name, arr in (("slots", slots), ("positions", positions)):
            if arr.ndim != 2 or arr.shape[0] != n:
                raise TreeError(f"{name}: expected shape ({n}, width), got {arr.shape}")
        if slots.shape != positions.shape:
            raise TreeError(f"positions: shape {positions.shape} differs from slots {slots.shape}")
        if terminal.shape != (n,):
            raise TreeError(f"terminal: expected shape ({n},), got {terminal.shape}")
        n_rec = key.records.shape[0]
        rec_slots = np.full((n_rec, slots.shape[1]), _EMPTY, dtype=np.int64)
        rec_positions = np.full_like(rec_slots, _EMPTY)
        rec_slots[key.token_record] = slots
        rec_positions[key.token_record] = np.where(slots >= 0, positions, _EMPTY)
        node = self._root(key.namespace)
        stamp = self._tick()
        self.epoch += 1
        self._ranked = None
        i = 0
        while i < n_rec:
            child = node.children.get(int(key.records[i]))
            if child is None:
                child = self._new_node(key.records[i:].copy(), node)
                common = n_rec - i
            else:
                common = _common_prefix(child.key, key.records[i:])
                if common < child.key.shape[0]:
                    child = self._split(child, common)
            lo, hi = i, i + common
            self._merge(child, rec_slots[lo:hi], rec_positions[lo:hi])
            self._touch(child, stamp)
            i = hi
            node = child
        if n_rec:
            node.terminal = np.asarray(terminal, dtype=np.int64).copy()

    def evict(self, n_slots: int) -> int:
        """Free at least ``n_slots`` slots if possible, in the module's drop-aware order (LRU within
        each rank). Returns the slots freed."""
        freed = 0
        if n_slots > 0:
            ranked = self._ranked = self._rank() if self._ranked is None else self._ranked
            for entries in ranked:
                while freed < n_slots and entries:
                    node, mask = entries.pop(0)
                    if node.attached:
                        freed += self._release(node, mask)
        while freed < n_slots and self._leaves:
            node = self._pop_valid(self._leaves)
            if node is not None and not node.children:
                freed += self._release(node, np.ones(node.slots.shape, dtype=bool))
        if freed < n_slots:
            for node in sorted(self._nodes(), key=lambda n: (n.last_access, n.uid)):
                if freed >= n_slots:
                    break
                if node.attached:
                    freed += self._release(node, np.ones(node.slots.shape, dtype=bool))
        if freed:
            self.epoch += 1
        return freed

    def ranks(self) -> dict[int, np.ndarray]:
        """Resident slots by eviction rank: :data:`DROPPED`, :data:`STALE`, and 2 for the rest."""
        ranked = self._rank()
        out = {rank: np.concatenate([node.slots[mask] for node, mask in ranked[rank]] or [np.zeros(0, np.int64)])
               for rank in (DROPPED, STALE)}
        out[2] = np.setdiff1d(self.resident_slots(), np.concatenate([out[DROPPED], out[STALE]]))
        return out

    def _rank(self) -> list[list[tuple[TreeNode, np.ndarray]]]:
        """Per rank, (node, cell mask) in LRU order: cells of tokens no recorded path keeps, and
        cells no recorded path reads."""
        kept: dict[int, np.ndarray] = {}
        read: dict[int, np.ndarray] = {}
        for path, terminal in self._paths():
            offset = 0
            for node in path:
                rows = np.flatnonzero(node.key >= 0)
                tokens = offset + np.arange(rows.size)
                offset += rows.size
                if terminal is None or tokens.size == 0 or offset > terminal.size:
                    continue
                final = terminal[tokens]
                k = kept.setdefault(node.uid, np.zeros(node.key.shape[0], dtype=bool))
                r = read.setdefault(node.uid, np.zeros(node.slots.shape, dtype=bool))
                k[rows] |= final >= 0
                r[rows] |= (node.positions[rows] == final[:, None]) & (final[:, None] >= 0)
        ranked: list[list[tuple[TreeNode, np.ndarray]]] = [[], []]
        for node in sorted(self._nodes(), key=lambda n: (n.last_access, n.uid)):
            held = node.slots >= 0
            k = kept.get(node.uid, np.zeros(node.key.shape[0], dtype=bool))
            r = read.get(node.uid, np.zeros(node.slots.shape, dtype=bool))
            dropped = held & ~k[:, None]
            stale = held & k[:, None] & ~r
            if dropped.any():
                ranked[DROPPED].append((node, dropped))
            if stale.any():
                ranked[STALE].append((node, stale))
        return ranked

    def _paths(self) -> list[tuple[list[TreeNode], np.ndarray | None]]:
        """Every root-to-leaf path with its leaf's recorded terminal."""
        out: list[tuple[list[TreeNode], np.ndarray | None]] = []
        stack = [[c] for root in self._roots.values() for c in root.children.values()]
        while stack:
            path = stack.pop()
            node = path[-1]
            if not node.children:
                out.append((path, node.terminal))
            stack.extend(path + [c] for c in node.children.values())
        return out

    def flush(self) -> None:
        """Give back every reference the tree holds and forget all paths."""
        for node in self._nodes():
            held = node.slots[node.slots >= 0]
            if held.size:
                self.pool.tree_decref(held)
            node.parent = None
        self._roots.clear()
        self._leaves.clear()
        self._ranked = None
        self._n_nodes = 0
        self.epoch += 1

    def _root(self, namespace: str) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            empty = np.zeros((0, 1), dtype=np.int64)
            root = TreeNode(np.zeros(0, dtype=np.int64), empty, empty.copy(), next(self._uids))
            self._roots[namespace] = root
        return root

    def _nodes(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, node: TreeNode, stamp: int) -> None:
        node.last_access = stamp
        if not node.children:
            self._push(self._leaves, node)

    def _push(self, heap: list[tuple[int, int, TreeNode]], node: TreeNode) -> None:
        heapq.heappush(heap, (node.last_access, node.uid, node))
        if len(heap) > 2 * self._n_nodes + 64:
            heap[:] = [e for e in heap if e[2].attached and e[0] == e[2].last_access]
            heapq.heapify(heap)

    @staticmethod
    def _pop_valid(heap: list[tuple[int, int, TreeNode]]) -> TreeNode | None:
        stamp, _, node = heapq.heappop(heap)
        return node if node.attached and stamp == node.last_access else None

    def _new_node(self, key: np.ndarray, parent: TreeNode) -> TreeNode:
        width = 1
        empty = np.full((key.shape[0], width), _EMPTY, dtype=np.int64)
        node = TreeNode(key, empty, empty.copy(), next(self._uids))
        node.parent = parent
        parent.terminal = None  # no longer a path end: the terminal of a leaf is all that is kept
        parent.children[int(key[0])] = node
        self._n_nodes += 1
        return node

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` records; the new upper node is returned, ``node`` keeps the rest."""
        parent = node.parent
        assert parent is not None
        upper = TreeNode(node.key[:at], node.slots[:at], node.positions[:at], next(self._uids))
        upper.parent = parent
        upper.last_access = node.last_access
        parent.children[int(upper.key[0])] = upper
        node.key, node.slots, node.positions = node.key[at:], node.slots[at:], node.positions[at:]
        node.parent = upper
        upper.children[int(node.key[0])] = node
        self._n_nodes += 1
        return upper

    def _merge(self, node: TreeNode, slots: np.ndarray, positions: np.ndarray) -> None:
        for j in range(slots.shape[1]):
            add = slots[:, j] >= 0
            add &= ~((node.positions == positions[:, j, None]) & (node.slots >= 0)).any(axis=1)
            if not add.any():
                continue
            free = node.slots < 0
            if not free[add].any(axis=1).all():
                node.slots = _widen(node.slots)
                node.positions = _widen(node.positions)
                free = node.slots < 0
            rows = np.flatnonzero(add)
            cols = free[rows].argmax(axis=1)
            node.slots[rows, cols] = slots[rows, j]
            node.positions[rows, cols] = positions[rows, j]
            self.pool.tree_incref(slots[rows, j])

    def _release(self, node: TreeNode, which: np.ndarray) -> int:
        held = (node.slots >= 0) & which
        if held.any():
            held &= self.pool.request_refs(np.where(held, node.slots, 0)) == 0
        count = 0
        if held.any():
            count = self.pool.tree_decref(node.slots[held])
            node.slots[held] = _EMPTY
            node.positions[held] = _EMPTY
        self._prune(node)
        return count

    def _prune(self, node: TreeNode) -> None:
        """Remove childless nodes without versions, walking up while that holds."""
        while node.attached and not node.children and not node.has_versions():
            parent = node.parent
            assert parent is not None
            del parent.children[int(node.key[0])]
            node.parent = None
            self._n_nodes -= 1
            self._ranked = None
            if parent.attached and not parent.children:
                self._push(self._leaves, parent)
            node = parent


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    k = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:k] != b[:k])
    return int(diff[0]) if diff.size else k


def _gather(parts: list[tuple[TreeNode, int]], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    width = max((node.slots.shape[1] for node, _ in parts), default=1)
    slots = [_pad(node.slots[:common], width) for node, common in parts]
    positions = [_pad(node.positions[:common], width) for node, common in parts]
    if not slots:
        empty = np.zeros((0, width), dtype=np.int64)
        return empty, empty.copy()
    return np.concatenate(slots)[rows], np.concatenate(positions)[rows]


def _pad(arr: np.ndarray, width: int) -> np.ndarray:
    if arr.shape[1] == width:
        return arr
    return np.pad(arr, ((0, 0), (0, width - arr.shape[1])), constant_values=_EMPTY)


def _widen(arr: np.ndarray) -> np.ndarray:
    return np.concatenate([arr, np.full((arr.shape[0], 1), _EMPTY, dtype=arr.dtype)], axis=1)

