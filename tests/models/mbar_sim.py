"""Primitives shared by the CPU models of the sm90 barrier protocols (protocol_model.py for the
forward, bwd_protocol_model.py for the backward): mbarriers with phases and transaction counts,
named barriers, and smem buffers that know who is reading them."""
from __future__ import annotations


class ProtocolError(AssertionError):
    pass


def check(cond, msg):
    if not cond:
        raise ProtocolError(msg)


class MBar:
    """mbarrier: a phase completes when `count` arrivals and all expected transaction bytes are in.
    strict: more arrivals than `count` within one phase are an error (a model whose every arrival
    is accounted for); otherwise they start the next phase, as on the hardware."""

    def __init__(self, count, strict=False):
        self.count, self.strict = count, strict
        self.arrived, self.tx, self.completed = 0, 0, 0

    def _maybe_complete(self):
        if self.arrived == self.count and self.tx == 0:
            self.completed += 1
            self.arrived = 0

    def arrive(self, n=1):
        if self.strict:
            check(self.arrived + n <= self.count, "too many arrivals in one phase")
        for _ in range(n):
            self.arrived += 1
            self._maybe_complete()

    def arrive_expect_tx(self, tx):
        self.tx += tx
        self.arrive()

    def complete_tx(self, tx):
        self.tx -= tx
        check(self.tx >= 0, "negative transaction count")
        self._maybe_complete()

    def ready(self, parity):  # mbarrier.try_wait.parity
        return (self.completed & 1) != parity


class NamedBar:
    """bar.sync / bar.arrive over `parties` warpgroups (e.g. 256 threads = 2)."""

    def __init__(self, parties=2):
        self.parties, self.pending, self.generation = parties, set(), 0

    def arrive(self, who):
        # A warpgroup arriving twice in one barrier instance would complete it on its own.
        check(who not in self.pending, f"{who} arrives twice on one named-barrier instance")
        self.pending.add(who)
        if len(self.pending) == self.parties:
            self.pending = set()
            self.generation += 1


class Buffer:
    """A smem buffer written by TMA (async) or by generic stores; readers = actors reading it."""

    def __init__(self, name):
        self.name, self.version, self.loaded, self.readers = name, None, False, set()

    def write(self, version, loaded=False):
        check(not self.readers, f"{self.name} (v{self.version}) overwritten while read by {sorted(self.readers)}")
        self.version, self.loaded = version, loaded
