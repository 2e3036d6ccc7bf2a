"""What the router remembers of request ids that are no longer live: the Result it sent for each (a
resubmitted id gets the same answer again), bounded by ``router.result_cache`` and, in bytes, by
``router.result_cache_mb``; and Aborts that came before their own Generate (that Generate is then
cancelled as it arrives), bounded by ``router.result_cache``."""

from __future__ import annotations

from collections import OrderedDict


class Answered:
    def __init__(self, cap: int, cap_bytes: int) -> None:
        self.cap = cap
        self.cap_bytes = cap_bytes
        self.bytes = 0
        """The kept Results' encoded size."""
        self._results: OrderedDict[str, bytes] = OrderedDict()
        self._early_aborts: OrderedDict[str, None] = OrderedDict()

    def result(self, rid: str) -> bytes | None:
        """The encoded Result already sent for ``rid``, if still remembered."""
        return self._results.get(rid)

    def keep(self, rid: str, payload: bytes) -> None:
        """Remember the Result sent for ``rid``, dropping the oldest beyond either bound (one larger than
        the whole byte bound is not kept: it would drop every other)."""
        old = self._results.pop(rid, None)
        if old is not None:
            self.bytes -= len(old)
        if len(payload) > self.cap_bytes or self.cap == 0:
            return
        self._results[rid] = payload
        self.bytes += len(payload)
        while self._results and (len(self._results) > self.cap or self.bytes > self.cap_bytes):
            self.bytes -= len(self._results.popitem(last=False)[1])

    def abort_unknown(self, rid: str) -> None:
        """An Abort for an id that is not live. A client's Abort can overtake its own Generate (the
        task that was to send it had not run yet, e.g. a session closed in the loop pass that started
        its call), so unless ``rid`` was already answered the Abort waits for it."""
        if rid not in self._results:
            self._early_aborts[rid] = None
            if len(self._early_aborts) > self.cap:
                self._early_aborts.popitem(last=False)

    def aborted_early(self, rid: str) -> bool:
        """Whether an Abort came before this Generate (asked once, as the Generate arrives)."""
        return self._early_aborts.pop(rid, False) is None
