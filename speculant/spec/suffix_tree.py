"""A depth-limited suffix tree of token sequences with occurrence counts (SuffixDecoding).

Every suffix of every sequence, cut at `max_depth` tokens, is a path from the root; a node's
`count` is the number of those suffixes that pass through or end at it, i.e. the number of
occurrences of the node's token string. SuffixDecoding (Oliaro et al., 2024,
arXiv:2411.04975) drafts by matching the end of a sequence against this tree and following
the most frequent children.

Memory layout (why it is cheap in Python): an uncompressed trie whose unique tails are not
materialised. A child that only one suffix reaches is a *leaf*, the tuple
`(sequence list, suffix start)`: its tokens are read from the sequence itself, so it grows for
free as the sequence grows. Only strings that occur at least twice get node lists, and a
leaf is split one level at a time when a second suffix reaches it. So a natural-language
history costs a few nodes per token, and appending a token only touches the suffixes of the
growing sequence that currently sit on shared nodes (at most `max_depth`, usually a handful).
Arctic Inference's C++ tree compresses edges instead; the counts, and so the drafts, are the
same.

Restriction: at most one sequence per tree grows at a time (`extend`); the others are complete
(`finish`). That covers both uses: a request's own tree and the global tree of past responses.
"""
from __future__ import annotations

from typing import Hashable


# A node is a list [count, children, best, best_count] (a list, not an object: the tree makes
# one per shared token, and a list literal costs a fraction of a constructor call):
#   count       occurrences of the node's token string (suffixes passing through or ending here)
#   children    {token: node list | leaf tuple (sequence list, suffix start)}
#   best        token of the child with the largest count (-1: no child)
#   best_count  that child's count; -1 while unknown (after a removal), then rescanned
Node = list


def _new_node(count: int = 0) -> Node:
    return [count, {}, -1, 0]


class Match:
    """Where a token string ends in the tree: on `node`, or `depth` tokens into `leaf`'s suffix."""

    __slots__ = ("node", "leaf", "depth")

    def __init__(self, node: Node | None, leaf: tuple[list[int], int] | None, depth: int):
        self.node, self.leaf, self.depth = node, leaf, depth


class SuffixTree:
    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _new_node()
        self._seqs: dict[Hashable, list[int]] = {}
        # per growing sequence: (node, suffix start) for its suffixes that end on a shared node
        self._active: dict[Hashable, list[tuple[Node, int]]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    # ---- building --------------------------------------------------------------------------

    def extend(self, key: Hashable, tokens: list[int]) -> None:
        """Append tokens to sequence `key` (created if new)."""
        seq = self._seqs.get(key)
        if seq is None:
            seq = self._seqs[key] = []
            self._active[key] = []
        elif key not in self._active:
            raise ValueError(f"suffix tree: sequence {key!r} is finished")
        active = self._active[key]
        root, max_depth = self.root, self.max_depth
        for tok in tokens:
            pos = len(seq)
            seq.append(tok)
            root[0] += 1
            active.append((root, pos))
            grown = []
            for node, start in active:
                depth = pos - start  # depth of node; the suffix now reaches depth + 1
                deeper = depth + 1 < max_depth
                children = node[1]
                child = children.get(tok)
                if child is None:  # first suffix here: a leaf, it needs no more work
                    children[tok] = (seq, start)
                    count = 1
                elif type(child) is tuple:  # second suffix: split the leaf one level
                    other_seq, other_start = child
                    nxt = other_start + depth + 1
                    if deeper and nxt < len(other_seq):
                        after = other_seq[nxt]
                        inner = [2, {after: child}, after, 1]
                    else:
                        inner = [2, {}, -1, 0]
                    children[tok] = inner
                    count = 2
                    if deeper:
                        grown.append((inner, start))
                else:
                    count = child[0] = child[0] + 1
                    if deeper:
                        grown.append((child, start))
                best_count = node[3]
                if best_count >= 0 and count > best_count:
                    node[2] = tok
                    node[3] = count
            active = grown
        self._active[key] = active

    def finish(self, key: Hashable) -> None:
        """Sequence `key` will not grow any more."""
        self._active.pop(key, None)

    def remove(self, key: Hashable) -> None:
        """Remove every suffix of sequence `key`."""
        seq = self._seqs.pop(key)
        self._active.pop(key, None)
        root, max_depth, n = self.root, self.max_depth, len(seq)
        for start in range(n):
            root[0] -= 1
            node = root
            for pos in range(start, min(n, start + max_depth)):
                tok = seq[pos]
                child = node[1][tok]
                node[3] = -1
                if type(child) is tuple:  # the leaf of this very suffix
                    del node[1][tok]
                    break
                child[0] -= 1
                if child[0] == 0:
                    del node[1][tok]
                    break
                node = child

    # ---- matching and drafting -------------------------------------------------------------

    def active_matches(self, key: Hashable) -> list[tuple[int, Match]]:
        """(match length, match) of every suffix of growing sequence `key` that occurred before
        in this tree, found without search (they are the suffixes still on shared nodes)."""
        n = len(self._seqs[key])
        return [(n - start, Match(node, None, n - start)) for node, start in self._active[key]]

    def match(self, pattern: list[int]) -> Match | None:
        """Where `pattern` ends in the tree, or None if it does not occur."""
        node, depth = self.root, 0
        for i, tok in enumerate(pattern):
            child = node[1].get(tok)
            if child is None:
                return None
            depth += 1
            if type(child) is tuple:
                seq, start = child
                rest = pattern[i + 1:]
                tail = start + depth
                if depth + len(rest) > self.max_depth or seq[tail:tail + len(rest)] != rest:
                    return None
                return Match(None, child, depth + len(rest))
            node = child
        return Match(node, None, depth)

    def count(self, pattern: list[int]) -> int:
        """Occurrences of `pattern` (at most max_depth tokens) in the tree's sequences."""
        m = self.match(pattern)
        if m is None:
            return 0
        return 1 if m.leaf is not None else m.node[0]

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
        max_depth = self.max_depth
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
            child = node[1][tok]
            is_leaf = type(child) is tuple
            prob *= (1 if is_leaf else child[0]) / node[0]
            if prob < min_token_prob:
                break
            token_ids.append(tok)
            path_probs.append(prob)
            depth += 1
            if is_leaf:
                leaf = child
            else:
                node = child
        return token_ids, path_probs

    @staticmethod
    def _best_child(node: Node) -> int:
        if node[3] < 0:  # stale after a removal: rescan
            node[2], node[3] = -1, 0
            for tok, child in node[1].items():
                count = 1 if type(child) is tuple else child[0]
                if count > node[3]:
                    node[2], node[3] = tok, count
        return node[2] if node[1] else -1
