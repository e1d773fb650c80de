"""A depth-limited suffix tree of token sequences with occurrence counts (SuffixDecoding).

Every suffix of every sequence, cut at `max_depth` tokens, is a path from the root; a node's
count is the number of those suffixes that pass through or end at it, i.e. the number of
occurrences of the node's token string. SuffixDecoding (Oliaro et al., 2024,
arXiv:2411.04975) drafts by matching the end of a sequence against this tree and following
the most frequent children.

Shape: an uncompressed trie whose unique tails are not materialised. A child that only one
suffix reaches is a *leaf*, which points at (sequence, suffix start): its tokens are read
from the sequence itself, so it grows for free as the sequence grows. Only strings that occur
at least twice get a node, and a leaf is split one level at a time when a second suffix
reaches it. A natural-language history costs a couple of nodes per token, and appending a
token only touches the suffixes of the growing sequence that currently sit on shared nodes
(at most `max_depth`, usually a handful). Arctic Inference's C++ tree compresses edges
instead; the counts, and so the drafts, are the same.

Memory layout (flat, so the garbage collector has nothing to traverse: int lists and dicts of
ints only): node i has `count[i]`, `best[i]` (token of its most frequent child, -1 if none),
`best_count[i]` (that child's count; -1 while unknown after a removal), and `children[i]`, a
dict {token: child code}. A child code >= 0 is a node id; a leaf is -1 - (slot << 32 | start),
with `slot` indexing the sequence list. Node 0 is the root (count = number of suffixes).

Restriction: at most one sequence per tree grows at a time (`extend`); the others are complete
(`finish`). That covers both uses: a request's own tree and the global tree of past responses.
"""
from __future__ import annotations

from typing import Hashable

_LOW32 = (1 << 32) - 1


class Match:
    """Where a token string ends in the tree: on node `node` (leaf None), or `depth` tokens
    into the suffix `leaf` = (sequence, start)."""

    __slots__ = ("node", "leaf", "depth")

    def __init__(self, node: int, leaf: tuple[list[int], int] | None, depth: int):
        self.node, self.leaf, self.depth = node, leaf, depth


class SuffixTree:
    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._count = [0]
        self._best = [-1]
        self._best_count = [0]
        self._children: list[dict[int, int]] = [{}]
        self._free_nodes: list[int] = []
        self._slot_seqs: list[list[int] | None] = []  # sequence of each slot
        self._free_slots: list[int] = []
        self._slots: dict[Hashable, int] = {}  # sequence key -> slot
        # per growing sequence: (node, suffix start) of its suffixes that end on a shared node
        self._active: dict[Hashable, list[tuple[int, int]]] = {}
        self.version = 0  # changes whenever the tree does: matches kept outside go stale

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def num_nodes(self) -> int:
        return len(self._children) - len(self._free_nodes)

    # ---- building --------------------------------------------------------------------------

    def _new_node(self, count: int) -> int:
        if self._free_nodes:
            node = self._free_nodes.pop()
            self._count[node], self._best[node], self._best_count[node] = count, -1, 0
            self._children[node] = {}
            return node
        self._count.append(count)
        self._best.append(-1)
        self._best_count.append(0)
        self._children.append({})
        return len(self._children) - 1

    def _leaf(self, code: int) -> tuple[list[int], int]:
        v = -1 - code
        return self._slot_seqs[v >> 32], v & _LOW32

    def extend(self, key: Hashable, tokens: list[int]) -> None:
        """Append tokens to sequence `key` (created if new)."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_seqs)
            if slot == len(self._slot_seqs):
                self._slot_seqs.append(None)
            self._slot_seqs[slot] = []
            self._slots[key] = slot
            self._active[key] = []
        elif key not in self._active:
            raise ValueError(f"suffix tree: sequence {key!r} is finished")
        seq, active = self._slot_seqs[slot], self._active[key]
        self.version += 1
        slot_bits = slot << 32
        counts, best, best_counts = self._count, self._best, self._best_count
        children, slot_seqs, max_depth = self._children, self._slot_seqs, self.max_depth
        for tok in tokens:
            pos = len(seq)
            seq.append(tok)
            counts[0] += 1
            active.append((0, pos))
            grown = []
            for node, start in active:
                depth = pos - start  # depth of node; the suffix now reaches depth + 1
                deeper = depth + 1 < max_depth
                node_children = children[node]
                child = node_children.get(tok)
                if child is None:  # first suffix here: a leaf, it needs no more work
                    node_children[tok] = -1 - (slot_bits | start)
                    count = 1
                elif child < 0:  # second suffix: split the leaf one level
                    v = -1 - child
                    other = slot_seqs[v >> 32]
                    nxt = (v & _LOW32) + depth + 1
                    inner = self._new_node(2) if self._free_nodes else len(children)
                    if inner == len(children):
                        counts.append(2)
                        best.append(-1)
                        best_counts.append(0)
                        children.append({})
                    if deeper and nxt < len(other):
                        after = other[nxt]
                        children[inner][after] = child
                        best[inner], best_counts[inner] = after, 1
                    node_children[tok] = inner
                    count = 2
                    if deeper:
                        grown.append((inner, start))
                else:
                    count = counts[child] + 1
                    counts[child] = count
                    if deeper:
                        grown.append((child, start))
                node_best = best_counts[node]
                if node_best >= 0 and count > node_best:
                    best[node], best_counts[node] = tok, count
            active = grown
        self._active[key] = active

    def finish(self, key: Hashable) -> None:
        """Sequence `key` will not grow any more."""
        self._active.pop(key, None)

    def remove(self, key: Hashable) -> None:
        """Remove every suffix of sequence `key`."""
        slot = self._slots.pop(key)
        seq = self._slot_seqs[slot]
        self._active.pop(key, None)
        self.version += 1
        counts, best_counts, children = self._count, self._best_count, self._children
        n, max_depth = len(seq), self.max_depth
        for start in range(n):
            counts[0] -= 1
            node, end = 0, min(n, start + max_depth)
            for pos in range(start, end):
                tok = seq[pos]
                child = children[node][tok]
                best_counts[node] = -1
                if child < 0:  # the leaf of this very suffix
                    del children[node][tok]
                    break
                counts[child] -= 1
                if counts[child] == 0:  # only this suffix used it: free the chain below
                    del children[node][tok]
                    self._free_chain(child, seq, pos + 1, end)
                    break
                node = child
        self._slot_seqs[slot] = None
        self._free_slots.append(slot)

    def _free_chain(self, node: int, seq: list[int], pos: int, end: int) -> None:
        while True:
            self._free_nodes.append(node)
            if pos >= end:
                return
            child = self._children[node].get(seq[pos])
            self._children[node] = {}
            if child is None or child < 0:
                return
            node, pos = child, pos + 1

    # ---- matching and drafting -------------------------------------------------------------

    def active_matches(self, key: Hashable) -> list[tuple[int, Match]]:
        """(match length, match) of every suffix of growing sequence `key` that occurred before
        in this tree, found without search (they are the suffixes still on shared nodes)."""
        n = len(self._slot_seqs[self._slots[key]])
        return [(n - start, Match(node, None, n - start)) for node, start in self._active[key]]

    def match(self, pattern: list[int]) -> Match | None:
        """Where `pattern` ends in the tree, or None if it does not occur."""
        node, depth, children = 0, 0, self._children
        for i, tok in enumerate(pattern):
            child = children[node].get(tok)
            if child is None:
                return None
            depth += 1
            if child < 0:
                seq, start = leaf = self._leaf(child)
                rest = pattern[i + 1:]
                tail = start + depth
                if depth + len(rest) > self.max_depth or seq[tail:tail + len(rest)] != rest:
                    return None
                return Match(-1, leaf, depth + len(rest))
            node = child
        return Match(node, None, depth)

    def advance(self, match: Match, tok: int) -> Match | None:
        """The match of the matched string followed by `tok`, or None if that does not occur."""
        depth = match.depth + 1
        if depth > self.max_depth:
            return None
        if match.leaf is not None:
            seq, start = match.leaf
            pos = start + match.depth
            return Match(-1, match.leaf, depth) if pos < len(seq) and seq[pos] == tok else None
        child = self._children[match.node].get(tok)
        if child is None:
            return None
        if child < 0:
            return Match(-1, self._leaf(child), depth)
        return Match(child, None, depth)

    def count(self, pattern: list[int]) -> int:
        """Occurrences of `pattern` (at most max_depth tokens) in the tree's sequences."""
        m = self.match(pattern)
        if m is None:
            return 0
        return 1 if m.leaf is not None else self._count[m.node]

    def suffix_matches(self, context: list[int]) -> list[tuple[int, Match]]:
        """(match length, match) for the suffixes of `context` of length 1, 2, ... that occur,
        up to max_depth - 1; stops at the first that does not (no longer one can occur)."""
        out = []
        for length in range(1, min(len(context), self.max_depth - 1) + 1):
            m = self.match(context[len(context) - length:])
            if m is None:
                break
            out.append((length, m))
        return out

    def best_path(self, match: Match, max_tokens: int,
                  min_token_prob: float) -> tuple[list[int], list[float]]:
        """Follow the most frequent child from `match` while the path probability stays at or
        above min_token_prob. Returns the tokens and, for each, the estimated probability of
        the path up to it (count of the path / count of the match)."""
        token_ids: list[int] = []
        path_probs: list[float] = []
        prob, depth, node, leaf = 1.0, match.depth, match.node, match.leaf
        max_depth, counts, children = self.max_depth, self._count, self._children
        while len(token_ids) < max_tokens:
            if leaf is not None:  # a single occurrence: copy it, probability unchanged
                seq, start = leaf
                pos = start + depth
                num = min(max_tokens - len(token_ids), max_depth - depth, len(seq) - pos)
                if num > 0:
                    token_ids.extend(seq[pos:pos + num])
                    path_probs.extend([prob] * num)
                break
            if depth >= max_depth:
                break
            tok = self._best_child(node)
            if tok < 0:
                break
            child = children[node][tok]
            prob *= (1 if child < 0 else counts[child]) / counts[node]
            if prob < min_token_prob:
                break
            token_ids.append(tok)
            path_probs.append(prob)
            depth += 1
            if child < 0:
                leaf = self._leaf(child)
            else:
                node = child
        return token_ids, path_probs

    def _best_child(self, node: int) -> int:
        if self._best_count[node] < 0:  # stale after a removal: rescan
            best, best_count = -1, 0
            for tok, child in self._children[node].items():
                count = 1 if child < 0 else self._count[child]
                if count > best_count:
                    best, best_count = tok, count
            self._best[node], self._best_count[node] = best, best_count
        return self._best[node] if self._children[node] else -1
