"""The turn lengths a step has finished, as a multiset of counts with rank queries: adding one and
reading a quantile each take O(log longest) steps (a Fenwick tree over the counts). A sorted list took
O(n) per turn to insert, which made a step of 200,000 turns spend seconds keeping it sorted."""

from __future__ import annotations


class Lengths:
    __slots__ = ("_counts", "_tree", "_n")

    def __init__(self) -> None:
        self._counts: list[int] = [0] * 1024
        """How many of each value, by value."""
        self._tree: list[int] = [0] * 1025
        """The Fenwick tree of ``_counts`` (1-based: ``_tree[i]`` sums the ``i & -i`` counts up to value ``i - 1``)."""
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def add(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"a length is not negative, got {value}")
        if value >= len(self._counts):
            self._grow(value)
        self._counts[value] += 1
        self._n += 1
        tree, i, size = self._tree, value + 1, len(self._counts)
        while i <= size:
            tree[i] += 1
            i += i & -i

    def _grow(self, value: int) -> None:
        size = len(self._counts)
        while size <= value:
            size *= 2
        self._counts.extend([0] * (size - len(self._counts)))
        tree = [0, *self._counts]  # built in O(size): each node passes its sum up to its parent
        for i in range(1, size + 1):
            parent = i + (i & -i)
            if parent <= size:
                tree[parent] += tree[i]
        self._tree = tree

    def kth(self, k: int) -> int:
        """The ``k``-th smallest (0-based: ``sorted()[k]``)."""
        if not 0 <= k < self._n:
            raise IndexError(f"rank {k} of {self._n} lengths")
        tree, size = self._tree, len(self._counts)
        pos, rest, step = 0, k + 1, size  # size is a power of two
        while step:
            nxt = pos + step
            if nxt <= size and tree[nxt] < rest:
                pos, rest = nxt, rest - tree[nxt]
            step >>= 1
        return pos

    def sorted(self) -> list[int]:
        out: list[int] = []
        for value, c in enumerate(self._counts):
            if c:
                out.extend([value] * c)
        return out
