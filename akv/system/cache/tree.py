"""Radix tree over record keys (tokens and cache events) whose token records carry KV versions.

Each node stores, per record of its edge, up to ``width`` versions (slot, position); event records
and missing KV hold -1. The tree takes one pool reference per version it adopts and gives it back
on eviction.

Eviction is drop-aware. A *path* is a root-to-leaf path whose end a publication recorded (the
leaf keeps that publication's terminal: the position each token is read at from the end, -1 when
dropped) and no later one replaced: one that continues it, or one that leaves it within the records
its publication generated (a next turn whose text does not repeat the reply as generated). Versions
of a token every path drops go first (vacuously so when no recorded path passes through), then *stale* versions no path reads (positions superseded by a Repos on every path that
keeps the token), then LRU leaves, then LRU inner versions. Evicting a version leaves a hole: the
structure stays, so the path still matches and a later request recomputes only what it must. Only
versions no request references are released.

Each node counts, per token record, the recorded paths below it that read the token and at which
positions (``read_pos``/``read_cnt``); a path end adds itself along its path when it is recorded
and takes itself back when it stops being a leaf or is pruned (a new leaf under a former path end
adds its own reads and, along the path above, only the reads its terminal changed), so ranking costs
at most O(path) per publication and O(nodes touched since) per eviction, never a walk of every path.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from akv.system.arrays import first_true
from akv.system.cache.keys import RecordKey
from akv.system.cache.plan import MatchResult, VersionRuns
from akv.system.cache.pool import SlotPool

_EMPTY = -1


class TreeError(ValueError):
    """Arguments to a tree operation are inconsistent; the message names the field and value."""


DROPPED, STALE = 0, 1
"""Eviction ranks before the LRU leaves: versions of tokens every path drops, versions no path reads."""


@dataclass(frozen=True)
class PathMark:
    """What a match of one key depended on (:meth:`RadixTree.mark`): the nodes it ran through with
    their change counts, and where it stopped (``end`` had no child for record ``next_record``;
    None: the match stopped inside a node, or at the key's end)."""

    namespace: str
    root: object
    parts: tuple[tuple[object, int, int, int], ...]  # (node, records matched, changes, read_changes)
    end: object
    next_record: int | None


class TreeNode:
    """One edge: ``key`` records with ``slots``/``positions`` arrays of shape (len, width);
    ``terminal``: the terminal (per token of the whole path) of the publication that ended here, and
    ``generated``: how many of the path's last records that publication generated (not its prompt)."""

    __slots__ = ("key", "n_tokens", "slots", "positions", "read_pos", "read_cnt", "terminal", "generated",
                 "children", "parent",
                 "last_access", "uid", "changes", "read_changes", "shared", "_held")

    def __init__(self, key: np.ndarray, slots: np.ndarray, positions: np.ndarray, uid: int,
                 read_pos: np.ndarray | None = None, read_cnt: np.ndarray | None = None) -> None:
        self.key = key
        self.n_tokens = int(np.count_nonzero(key >= 0))  # its token records (the rest are events)
        self.slots = slots
        self.positions = positions
        self.read_pos = np.full((key.shape[0], 1), _EMPTY, dtype=np.int64) if read_pos is None else read_pos
        self.read_cnt = np.zeros((key.shape[0], 1), dtype=np.int64) if read_cnt is None else read_cnt
        self.terminal: np.ndarray | None = None
        self.generated = 0
        self.children: dict[int, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.last_access = 0
        self.uid = uid
        self.changes = 0  # edits of its records or versions (what a match of a path through it returns)
        self.read_changes = 0  # edits of its read counts or terminal (which versions a request may take)
        self.shared = False  # a match holds its version arrays: copy them before writing
        self._held: np.ndarray | None = None  # per record: some version is resident (None: not known)

    def writable(self) -> None:
        """Make the version arrays safe to write in place (a match made earlier keeps what it saw)."""
        if self.shared:
            self.slots, self.positions = self.slots.copy(), self.positions.copy()
            self.shared = False

    @property
    def attached(self) -> bool:
        return self.parent is not None

    def has_versions(self) -> bool:
        return bool((self.slots >= 0).any())

    def held(self) -> np.ndarray:
        """Per record: at least one version is resident (kept until the versions change; never
        written in place, so a match may hold it)."""
        if self._held is None:
            out = self.slots[:, 0] >= 0
            for j in range(1, self.slots.shape[1]):  # by column: any(axis=1) over a few columns is ~10x slower
                out |= self.slots[:, j] >= 0
            out.flags.writeable = False
            self._held = out
        return self._held

    def ranked(self) -> tuple[np.ndarray, np.ndarray]:
        """Cell masks: versions of tokens no recorded path keeps, and versions no recorded path reads."""
        held = self.slots >= 0
        counted = self.read_cnt > 0
        kept = counted.any(axis=1)
        read = ((self.positions[:, :, None] == self.read_pos[:, None, :]) & counted[:, None, :]).any(axis=2)
        return held & ~kept[:, None], held & kept[:, None] & ~read


class RadixTree:
    """Match, insert (split as needed), drop-aware eviction and flush over one slot pool."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self._uids = itertools.count()
        self._roots: dict[str, TreeNode] = {}
        self._clock = 0
        self._n_nodes = 0
        self._leaves: list[tuple[int, int, TreeNode]] = []
        self._dirty: set[TreeNode] = set()
        self._ranked: tuple[set[TreeNode], set[TreeNode]] = (set(), set())
        self._unread: dict[TreeNode, np.ndarray] = {}  # slots of each ranked node's DROPPED and STALE versions
        self._refreshes = 0
        self._spare: tuple[tuple[int, int], int] | None = None
        self.epoch = 0
        self._shape = 0  # changes of the tree's structure (nodes added, split or removed)
        self._most_generated = 0  # the most generated records any publication had
        self._last_path: tuple[RecordKey, int, list[tuple[TreeNode, int]]] | None = None

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

    def match(self, key: RecordKey, hidden: np.ndarray | None = None) -> MatchResult:
        """Longest record prefix present in the tree, cut back to whole tokens, with their versions
        (read lazily from the matched nodes as they are now; versions in ``hidden``, ascending slots,
        count as absent)."""
        parts = self._path(key)
        stamp = self._tick()
        for child, _ in parts:
            self._touch(child, stamp)
        i = sum(common for _, common in parts)
        n_tokens = key.tokens_within(i)
        runs = []
        for node, common in parts:
            node.shared = True
            whole = common == node.key.shape[0]  # the match reads no row it does not ask for
            slots, positions, held = node.slots, node.positions, node.held()
            runs.append((slots, positions, held) if whole else (slots[:common], positions[:common], held[:common]))
        starts = np.cumsum([0] + [common for _, common in parts[:-1]]).astype(np.int64)
        source = VersionRuns(runs, starts, key.token_record[:n_tokens], hidden)
        return MatchResult(n_tokens=n_tokens, n_records=i, source=source)

    def mark(self, key: RecordKey) -> PathMark:
        """The path ``key`` matches now, to tell later whether a match of it could differ
        (:meth:`unchanged`)."""
        root = self._root(key.namespace)
        parts = self._path(key)
        end, next_record, i = root, None, sum(common for _, common in parts)
        if not parts or parts[-1][1] == parts[-1][0].key.shape[0]:
            end = parts[-1][0] if parts else root
            next_record = int(key.records[i]) if i < key.records.shape[0] else None
        marks = tuple((node, common, node.changes, node.read_changes) for node, common in parts)
        return PathMark(key.namespace, root, marks, end, next_record)

    def unchanged(self, mark: PathMark, taken_rows: np.ndarray) -> bool:
        """Whether a match of the key ``mark`` was taken for would find the same records and versions,
        and a plan that rotates in place the versions of the key's records ``taken_rows`` may still
        do so: no node of its path was split, pruned or had versions added or removed, no child
        continues it past its end, and, when ``taken_rows`` is not empty, neither the path's last node
        nor a node holding a taken version has new readers (other read changes only mean that a plan
        made now might rotate more in place)."""
        if self._roots.get(mark.namespace) is not mark.root:
            return False
        holding = None
        for i, (node, common, changes, read_changes) in enumerate(mark.parts):
            if not node.attached or node.changes != changes:
                return False
            if node.read_changes != read_changes and taken_rows.size:
                if holding is None:
                    ends = np.cumsum([part[1] for part in mark.parts])
                    holding = np.zeros(len(mark.parts), dtype=bool)
                    holding[np.searchsorted(ends, taken_rows, side="right")] = True
                    holding[-1] = True
                if holding[i]:
                    return False
        return mark.next_record is None or mark.next_record not in mark.end.children

    def exclusive(self, key: RecordKey, match: MatchResult, tokens: np.ndarray | None = None) -> np.ndarray:
        """Which versions of ``match`` (a match of ``key``) only a request continuing ``key`` could read:
        no request references the slot, and no recorded path reads it, except the paths whose ends
        the request's publication replaces (:meth:`publish`): the one ending where the match ends
        (the request's own earlier turn), and those ``key`` leaves within their generated tokens.
        Rows of ``match.slots`` for ``tokens`` (matched token indexes; default all)."""
        tokens = np.arange(match.n_tokens) if tokens is None else np.asarray(tokens, dtype=np.int64)
        out = np.zeros((tokens.size, match.width), dtype=bool)
        parts = self._path(key)
        rows = key.token_record[tokens]
        if not parts or rows.size == 0:
            return out
        lengths = np.asarray([common for _, common in parts], dtype=np.int64)
        ends = np.cumsum(lengths)
        leaf, common = parts[-1]
        own = [leaf] if common == leaf.key.shape[0] and leaf.terminal is not None else []
        own += self._left_behind(key, parts)
        end_reads = [end.terminal[tokens] for end in own if end.terminal.size >= match.n_tokens]
        slots, positions = match.versions(tokens)
        free = (slots >= 0) & (self.pool.request_refs(np.where(slots >= 0, slots, 0)) == 0)
        ordered = rows.size < 2 or not (rows[1:] < rows[:-1]).any()
        bounds = np.searchsorted(rows, np.concatenate([[0], ends])).tolist() if ordered else None
        which = None if ordered else np.searchsorted(ends, rows, side="right")
        for p, (node, _) in enumerate(parts):
            if bounds is not None:  # ascending rows (as a plan asks): each node's are a run
                if bounds[p + 1] == bounds[p]:
                    continue
                mine = np.arange(bounds[p], bounds[p + 1])
            else:
                assert which is not None
                mine = np.flatnonzero(which == p)
                if mine.size == 0:
                    continue
            local = rows[mine] - (ends[p] - lengths[p])
            read_pos, read_cnt = node.read_pos[local], node.read_cnt[local]
            counts = ((positions[mine][:, :, None] == read_pos[:, None, :]) * read_cnt[:, None, :]).sum(axis=2)
            own_counts = sum((positions[mine] == reads[mine][:, None]).astype(np.int64) for reads in end_reads)
            out[mine] = free[mine] & (counts == own_counts)
        return out

    def take(self, key: RecordKey, tokens: np.ndarray, slots: np.ndarray) -> None:
        """Give up the tree's versions held in ``slots``, ``slots[i]`` a version of matched token
        ``tokens[i]`` of ``key`` (a request holds them and rotates them in place, publishing them
        again when it finishes). Touches only the nodes holding them."""
        slots = np.asarray(slots, dtype=np.int64)
        tokens = np.asarray(tokens, dtype=np.int64)
        if slots.size == 0:
            return
        if tokens.shape != slots.shape:
            raise TreeError(f"tokens: shape {tokens.shape} does not match slots {slots.shape}")
        parts = self._path(key)
        rows = key.token_record[tokens]
        starts = np.cumsum([0] + [common for _, common in parts])
        which = np.searchsorted(starts, rows, side="right") - 1
        found = 0
        for p in np.unique(which[which < len(parts)]).tolist():
            node, common = parts[p]
            mine = np.flatnonzero(which == p)
            local = rows[mine] - starts[p]
            cells = node.slots[local] == slots[mine, None]
            hit = cells.any(axis=1)
            found += int(np.count_nonzero(hit))
            node.writable()
            node.slots[local[hit]] = np.where(cells[hit], _EMPTY, node.slots[local[hit]])
            node.positions[local[hit]] = np.where(cells[hit], _EMPTY, node.positions[local[hit]])
            self._changed(node)
        if found != slots.size:
            raise TreeError(f"slots: {slots.size - found} of the {slots.size} slots to take are not on the key's path")
        self.pool.tree_decref(slots)
        self.epoch += 1

    def _path(self, key: RecordKey) -> list[tuple[TreeNode, int]]:
        """The nodes ``key`` runs through and how many of each one's records it matches (as
        :meth:`match`, without touching them). The last key's path is kept while the structure holds
        (a request's match, mark, plan and commit walk the same path), and a key extending it
        (:attr:`RecordKey.base`: what a request publishes) walks on from its end."""
        last = self._last_path
        parts: list[tuple[TreeNode, int]] = []
        node, i = self._root(key.namespace), 0
        records = key.records
        if last is not None and last[1] == self._shape and (last[0] is key or key.base is last[0]):
            if last[0] is key:
                return list(last[2])
            parts = list(last[2])
            i = sum(common for _, common in parts)
            if parts:
                node, common = parts[-1]
                if common < node.key.shape[0]:  # stopped inside the node: a mismatch, or the base's end
                    more = _common_prefix(node.key[common:], records[i:])
                    parts[-1] = (node, common + more)
                    i += more
                    if common + more < node.key.shape[0]:
                        self._last_path = (key, self._shape, list(parts))
                        return parts
        while i < records.shape[0]:
            child = node.children.get(int(records[i]))
            if child is None:
                break
            common = _common_prefix(child.key, records[i:])
            parts.append((child, common))
            i += common
            if common < child.key.shape[0]:
                break
            node = child
        self._last_path = (key, self._shape, list(parts))
        return parts

    def insert(self, key: RecordKey, slots: np.ndarray, positions: np.ndarray, terminal: np.ndarray,
               generated: int = 0) -> np.ndarray:
        """Publish versions for ``key``'s tokens: ``slots[t, j]`` at ``positions[t, j]`` (-1 = none).

        Versions the tree lacks are adopted (the tree takes a reference); duplicates of a resident
        (token, position) are left to the caller. ``terminal[t]`` is the position token ``t`` is read
        at from the end of this path (-1 when dropped); the path's end keeps it to rank eviction, and
        how many of its last tokens the request ``generated``. A path that leaves a recorded end within
        that end's generated tokens (the next turn of a conversation whose text does not repeat the
        reply as generated: a re-rendered or replayed assistant message) replaces that end: nothing
        continues it any more, so its reads no longer hold versions for it.
        Returns the slot now resident for each given version (``slots``' shape; -1 where none was
        given): its own, or the resident duplicate's.
        """
        n = key.n_tokens
        for name, arr in (("slots", slots), ("positions", positions)):
            if arr.ndim != 2 or arr.shape[0] != n:
                raise TreeError(f"{name}: expected shape ({n}, width), got {arr.shape}")
        if slots.shape != positions.shape:
            raise TreeError(f"positions: shape {positions.shape} differs from slots {slots.shape}")
        given = np.flatnonzero(slots[:, 0] >= 0 if slots.shape[1] == 1 else (slots >= 0).any(axis=1))
        resident = slots.copy()
        resident[given] = self.publish(key, given, slots[given], positions[given], terminal, generated)
        return resident

    def publish(self, key: RecordKey, tokens: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                terminal: np.ndarray, generated: int = 0) -> np.ndarray:
        """:meth:`insert` of only the tokens given versions: ``slots[i, j]`` at ``positions[i, j]``
        (-1 = none) are versions of token ``tokens[i]`` (ascending, distinct). Reads and writes only
        the rows of those tokens (and the records of a new leaf); returns ``slots``' resident slots."""
        n = key.n_tokens
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or (tokens.size and (tokens[0] < 0 or tokens[-1] >= n or (np.diff(tokens) <= 0).any())):
            raise TreeError(f"tokens: expected distinct ascending token indexes below {n}, got {tokens[:8].tolist()}")
        for name, arr in (("slots", slots), ("positions", positions)):
            if arr.ndim != 2 or arr.shape[0] != tokens.size:
                raise TreeError(f"{name}: expected shape ({tokens.size}, width), got {arr.shape}")
        if slots.shape != positions.shape:
            raise TreeError(f"positions: shape {positions.shape} differs from slots {slots.shape}")
        if terminal.shape != (n,):
            raise TreeError(f"terminal: expected shape ({n},), got {terminal.shape}")
        n_rec = key.records.shape[0]
        positions = np.where(slots >= 0, positions, _EMPTY)
        given_records = key.token_record[tokens]
        resident = slots.copy()
        parts = self._path(key)
        ends = np.cumsum([common for _, common in parts], dtype=np.int64)
        bounds = np.searchsorted(given_records, ends).tolist()  # the given rows within each part
        left = self._left_behind(key, parts)
        node = self._root(key.namespace)
        stamp = self._tick()
        self.epoch += 1
        i, lo = 0, 0
        for (child, common), hi in zip(parts, bounds):
            if common < child.key.shape[0]:
                child = self._split(child, common)
            if hi > lo:  # only the rows given a version are read (as a slice where they are a run)
                records = given_records[lo:hi] - i
                first, last = int(records[0]), int(records[-1])
                rows = slice(first, last + 1) if last - first + 1 == hi - lo else records
                resident[lo:hi] = self._merge(child, rows, slots[lo:hi], positions[lo:hi])
            self._touch(child, stamp)
            i, lo, node = i + common, hi, child
        if i < n_rec:
            records = given_records[lo:] - i
            leaf, own = self._new_leaf(node, key.records[i:].copy(), _spread(slots[lo:], records, n_rec - i),
                                       _spread(positions[lo:], records, n_rec - i))
            resident[lo:] = own[records]
            self._touch(leaf, stamp)
            node = leaf
        if n_rec and not node.children:
            self._end_path(node, np.asarray(terminal, dtype=np.int64))
            if node.generated != generated:
                node.generated = generated
                node.read_changes += 1
            self._most_generated = max(self._most_generated, generated)
        for end in left:
            self._forget_end(end)
        return resident

    def _left_behind(self, key: RecordKey, parts: list[tuple[TreeNode, int]]) -> list[TreeNode]:
        """The recorded path ends that ``key`` (whose path is ``parts``) leaves within their generated
        records: below where it parts from the tree."""
        matched = sum(common for _, common in parts)
        if not parts or matched >= key.records.shape[0]:
            return []
        node, common = parts[-1]
        if common < node.key.shape[0]:  # it parts inside the node
            return self._left_ends([node], matched - common, matched)
        return self._left_ends(list(node.children.values()), matched, matched)

    def _left_ends(self, nodes: list[TreeNode], start: int, at: int) -> list[TreeNode]:
        """The recorded path ends under ``nodes`` (which start ``start`` records from the root) that a
        path leaving them ``at`` records from the root leaves within their generated records."""
        out, todo = [], [(node, start) for node in nodes]
        while todo:
            node, begin = todo.pop()
            end = begin + node.key.shape[0]
            if node.terminal is not None and end - at <= node.generated:
                out.append(node)
            if end - at < self._most_generated:
                todo.extend((child, end) for child in node.children.values())
        return out

    def evict(self, n_slots: int) -> int:
        """Free at least ``n_slots`` slots if possible, in the module's drop-aware order (LRU within
        each rank). Returns the slots freed."""
        freed = 0
        if n_slots > 0:
            self._refresh()
            for rank in (DROPPED, STALE):
                # a release can prune a path end and so turn versions of the other nodes DROPPED: the
                # second pass takes both ranks
                nodes = self._ranked[DROPPED] | (self._ranked[STALE] if rank == STALE else set())
                for node in sorted(nodes, key=lambda n: (n.last_access, n.uid)):
                    if freed >= n_slots:
                        break
                    masks = node.ranked() if node.attached else None
                    if masks is not None:
                        freed += self._release(node, masks[DROPPED] | masks[rank])
                    self._dirty.add(node)
                self._refresh()
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
        masks = [(node, *node.ranked()) for node in self._nodes()]
        out = {rank: np.concatenate([m[0].slots[m[1 + rank]] for m in masks] or [np.zeros(0, np.int64)])
               for rank in (DROPPED, STALE)}
        out[2] = np.setdiff1d(self.resident_slots(), np.concatenate([out[DROPPED], out[STALE]]))
        return out

    def n_spare(self) -> int:
        """Slots that evicting the :data:`DROPPED` and :data:`STALE` ranks frees now, before any
        version a recorded path reads: distinct slots no request references, each of whose tree
        references is such a version. Cached until a reference or a rank changes."""
        self._refresh()
        key = (self.pool.changes, self._refreshes)
        if self._spare is None or self._spare[0] != key:
            slots = np.concatenate(list(self._unread.values()) or [np.zeros(0, np.int64)])
            single = self.pool.tree_refs(slots) == 1  # the usual case: this version is the slot's one tree reference
            n = int(np.count_nonzero(single & (self.pool.request_refs(slots) == 0)))
            shared, listed = np.unique(slots[~single], return_counts=True)
            n += int(np.count_nonzero((self.pool.tree_refs(shared) == listed) & (self.pool.request_refs(shared) == 0)))
            self._spare = (key, n)
        return self._spare[1]

    def _refresh(self) -> None:
        """Re-rank the nodes whose versions or read counts changed since the last eviction or count."""
        if self._dirty:
            self._refreshes += 1
        for node in self._dirty:
            masks = node.ranked() if node.attached else None
            for rank in (DROPPED, STALE):
                if masks is not None and masks[rank].any():
                    self._ranked[rank].add(node)
                else:
                    self._ranked[rank].discard(node)
            if node in self._ranked[DROPPED] or node in self._ranked[STALE]:
                self._unread[node] = node.slots[masks[DROPPED] | masks[STALE]]
            else:
                self._unread.pop(node, None)
        self._dirty.clear()

    def _end_path(self, leaf: TreeNode, terminal: np.ndarray) -> None:
        """Record the path ending at ``leaf``. A new leaf under a former path end takes that end
        over; when ``terminal`` extends the end's own, only the leaf's reads are new."""
        parent = leaf.parent
        assert parent is not None
        old = parent.terminal
        if old is not None:
            if leaf.terminal is None:
                parent.terminal = None
                parent.generated = 0
                leaf.terminal = terminal.copy()
                parent.read_changes += 1
                leaf.read_changes += 1
                changed = np.flatnonzero(terminal[: old.size] != old)
                if changed.size:  # the path above reads some tokens elsewhere now: count only those
                    self._count_changes(parent, changed, old[changed], -1)
                    self._count_changes(parent, changed, terminal[changed], 1)
                self._count_node(leaf, terminal[old.size :], 1)
                return
            self._forget_end(parent)
        self._record_end(leaf, terminal)

    def _record_end(self, node: TreeNode, terminal: np.ndarray) -> None:
        """Make leaf ``node`` the end of a recorded path with ``terminal`` (replacing its own)."""
        if node.terminal is not None:
            if np.array_equal(node.terminal, terminal):
                return
            self._count_end(node, -1)
        node.terminal = terminal.copy()
        node.read_changes += 1
        self._count_end(node, 1)

    def _forget_end(self, node: TreeNode) -> None:
        if node.terminal is not None:
            self._count_end(node, -1)
            node.terminal = None
            node.generated = 0
            node.read_changes += 1

    def _count_end(self, end: TreeNode, delta: int) -> None:
        """Add (+1) or take back (-1) the reads of the path ending at ``end`` in every node on it."""
        terminal = end.terminal
        assert terminal is not None
        stop = terminal.size
        node: TreeNode | None = end
        while node is not None and node.attached:
            stop -= self._count_node(node, terminal[: stop], delta)
            node = node.parent

    def _count_changes(self, end: TreeNode, tokens: np.ndarray, positions: np.ndarray, delta: int) -> None:
        """Add ``delta`` to the reads of path tokens ``tokens`` (ascending) at ``positions`` (-1: not
        read), on the path ending at ``end``; visits only the nodes holding them."""
        stop = 0  # tokens of the path from the root to the current node's end
        node: TreeNode | None = end
        nodes = []
        while node is not None and node.attached:
            nodes.append(node)
            stop += node.n_tokens
            node = node.parent
        if tokens.size == 0:
            return
        first, last = int(tokens[0]), int(tokens[-1])
        for node in nodes:
            start = stop - node.n_tokens
            if start > last or stop <= first:  # none of the tokens is here
                stop = start
                if stop <= first:
                    break
                continue
            lo, hi = np.searchsorted(tokens, [start, stop]).tolist()
            stop = start
            if hi == lo:
                continue
            read = positions[lo:hi] >= 0
            if read.any():
                rows = np.flatnonzero(node.key >= 0)[tokens[lo:hi][read] - start]
                _count_reads(node, rows, positions[lo:hi][read], delta)
                self._changed(node, reads=True)

    def _count_node(self, node: TreeNode, terminal: np.ndarray, delta: int) -> int:
        """Count the reads of ``node``'s tokens, the last entries of ``terminal``; returns how many
        tokens the node has."""
        rows = np.flatnonzero(node.key >= 0)
        final = terminal[terminal.size - rows.size :]
        kept = final >= 0
        if kept.all():
            _count_reads(node, rows, final, delta)
            self._changed(node, reads=True)
        elif kept.any():
            _count_reads(node, rows[kept], final[kept], delta)
            self._changed(node, reads=True)
        return rows.size

    def flush(self) -> None:
        """Give back every reference the tree holds and forget all paths."""
        for node in self._nodes():
            held = node.slots[node.slots >= 0]
            if held.size:
                self.pool.tree_decref(held)
            node.parent = None
        self._roots.clear()
        self._shape += 1
        self._leaves.clear()
        self._dirty.clear()
        self._unread.clear()
        for ranked in self._ranked:
            ranked.clear()
        self._n_nodes = 0
        self.epoch += 1

    def _root(self, namespace: str) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            empty = np.zeros((0, 1), dtype=np.int64)
            root = TreeNode(np.zeros(0, dtype=np.int64), empty, empty.copy(), next(self._uids))
            self._roots[namespace] = root
            self._shape += 1
        return root

    def _nodes(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _changed(self, node: TreeNode, reads: bool = False) -> None:
        """``node``'s versions or records (``reads``: its read counts) changed: re-rank it, and a
        :class:`PathMark` through it no longer holds."""
        if reads:
            node.read_changes += 1
        else:
            node.changes += 1
            node._held = None
        self._dirty.add(node)

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

    def _new_leaf(self, parent: TreeNode, key: np.ndarray, slots: np.ndarray,
                  positions: np.ndarray) -> tuple[TreeNode, np.ndarray]:
        """A leaf under ``parent`` for records ``key`` holding their given versions (what
        :meth:`_merge` does for a node that holds nothing yet), and the slots resident for them."""
        if slots.shape[1] == 1:
            node = TreeNode(key, slots.copy(), positions.copy(), next(self._uids))
        else:
            empty = np.full((key.shape[0], 1), _EMPTY, dtype=np.int64)
            node = TreeNode(key, empty, empty.copy(), next(self._uids))
        node.parent = parent
        parent.children[int(key[0])] = node
        self._n_nodes += 1
        self._shape += 1
        if slots.shape[1] > 1:
            return node, self._merge(node, slice(0, key.shape[0]), slots, positions)
        held = slots[:, 0] >= 0
        if held.any():
            self.pool.tree_incref(slots[:, 0][held])
            self._changed(node)
        return node, slots

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` records; the new upper node is returned, ``node`` keeps the rest."""
        parent = node.parent
        assert parent is not None
        upper = TreeNode(node.key[:at], node.slots[:at], node.positions[:at], next(self._uids),
                         node.read_pos[:at], node.read_cnt[:at])
        upper.parent = parent
        upper.last_access = node.last_access
        upper.shared = node.shared
        parent.children[int(upper.key[0])] = upper
        node.key, node.slots, node.positions = node.key[at:], node.slots[at:], node.positions[at:]
        node.n_tokens -= upper.n_tokens
        node.read_pos, node.read_cnt = node.read_pos[at:], node.read_cnt[at:]
        self._changed(node)
        self._changed(upper)
        node.parent = upper
        upper.children[int(node.key[0])] = node
        self._n_nodes += 1
        self._shape += 1
        return upper

    def _merge(self, node: TreeNode, rows: np.ndarray | slice, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Add the versions ``slots[i, j]`` at ``positions[i, j]`` (-1: none) of the node's records
        ``rows[i]`` (an index or a slice) that it lacks; returns the slot resident for each given one.
        Reads only those rows (a publication adds a few versions to a long path)."""
        resident = slots.copy()
        index = np.arange(slots.shape[0])
        if isinstance(rows, slice):
            rows_index = index + rows.start
        else:
            rows_index = rows
        for j in range(slots.shape[1]):
            held_slots, held_positions = node.slots[rows], node.positions[rows]
            duplicate, at = first_true((held_positions == positions[:, j, None]) & (held_slots >= 0))
            if duplicate.any():
                resident[index[duplicate], j] = held_slots[index[duplicate], at[duplicate]]
            add = (slots[:, j] >= 0) & ~duplicate
            if not add.any():
                continue
            target = rows_index[add]
            node.writable()
            has_free, cols = first_true(node.slots[target] < 0)
            if not has_free.all():
                node.slots = _widen(node.slots)
                node.positions = _widen(node.positions)
                cols = first_true(node.slots[target] < 0)[1]
            node.slots[target, cols] = slots[add, j]
            node.positions[target, cols] = positions[add, j]
            self.pool.tree_incref(slots[add, j])
            self._changed(node)
        return resident

    def _release(self, node: TreeNode, which: np.ndarray) -> int:
        held = (node.slots >= 0) & which
        if held.any():
            held &= self.pool.request_refs(np.where(held, node.slots, 0)) == 0
        count = 0
        if held.any():
            count = self.pool.tree_decref(node.slots[held])
            node.writable()
            node.slots[held] = _EMPTY
            node.positions[held] = _EMPTY
            self._changed(node)
        self._prune(node)
        return count

    def _prune(self, node: TreeNode) -> None:
        """Remove childless nodes without versions, walking up while that holds."""
        while node.attached and not node.children and not node.has_versions():
            parent = node.parent
            assert parent is not None
            self._forget_end(node)
            del parent.children[int(node.key[0])]
            node.parent = None
            self._n_nodes -= 1
            self._shape += 1
            self._changed(node)
            if parent.attached and not parent.children:
                self._push(self._leaves, parent)
            node = parent


def _count_reads(node: TreeNode, rows: np.ndarray, positions: np.ndarray, delta: int) -> None:
    """Add ``delta`` to the count of paths reading row ``rows[i]`` at ``positions[i]``."""
    if node.read_cnt.shape[1] == 1:  # one position per row so far: no column to choose
        read_pos, read_cnt = node.read_pos[:, 0], node.read_cnt[:, 0]
        counted = read_cnt[rows]
        found = (read_pos[rows] == positions) & (counted > 0)
        if found.all() or (delta > 0 and not counted[~found].any()):
            read_pos[rows] = positions
            read_cnt[rows] = counted + delta
            return
    match = (node.read_pos[rows] == positions[:, None]) & (node.read_cnt[rows] > 0)
    found, cols = first_true(match)
    if delta < 0 and not found.all():
        raise TreeError(f"read_cnt: row {int(rows[~found][0])} of a recorded path was never counted")
    if not found.all():
        new_rows = rows[~found]
        has_free, free_cols = first_true(node.read_cnt[new_rows] == 0)
        if not has_free.all():
            node.read_pos = _widen(node.read_pos)
            node.read_cnt = np.concatenate([node.read_cnt, np.zeros((node.read_cnt.shape[0], 1), np.int64)], axis=1)
            free_cols = first_true(node.read_cnt[new_rows] == 0)[1]
        node.read_pos[new_rows, free_cols] = positions[~found]
        cols[~found] = free_cols
    node.read_cnt[rows, cols] += delta


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    k = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:k] != b[:k])
    return int(diff[0]) if diff.size else k


def _spread(values: np.ndarray, token_record: np.ndarray, n_records: int) -> np.ndarray:
    """Per-record rows: ``values[t]`` at record ``token_record[t]``, -1 rows elsewhere (taken row-wise
    from an index, as numpy assigns rows by a fancy index ~10x slower than it takes them)."""
    index = np.full(n_records, values.shape[0], dtype=np.int64)
    index[token_record] = np.arange(values.shape[0])
    return np.take(np.concatenate([values, np.full((1, values.shape[1]), _EMPTY, dtype=values.dtype)]), index, axis=0)


def _widen(arr: np.ndarray) -> np.ndarray:
    out = np.empty((arr.shape[0], arr.shape[1] + 1), dtype=arr.dtype)
    out[:, :-1] = arr
    out[:, -1] = _EMPTY
    return out

