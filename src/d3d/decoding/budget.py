"""How many drafts a generation in a batch verifies per round (d3d.scheduler): alone a drafter's block is
verified whole, as it always was; in a batch every extra token widens a forward that the other generations
wait for, so the draft is cut to the length that gives the batch the most committed tokens per second, and
to nothing where drafting does not pay at all.

The choice uses the measured width cost curve (d3d.decoding.treecost.WidthCost), the other generations' last
forward (SlotModel.batch_load), this generation's acceptance rate per draft position (decayed counts, from
verified rounds only) and the seconds its proposer takes per round (in a batch the generations' Python and
drafter work runs one after the other, so it delays every forward). It is fixed before the round from earlier
rounds, so sampling stays exact.
"""
from __future__ import annotations

import math
import time

PRIOR = (1.0, 2.0)   # per-position acceptance before any round: 1 accepted of 2 tried
DECAY = 0.95
PROBE_ROUNDS = 8     # a generation that stopped drafting drafts again this often, to see whether it pays ...
PROBE_LENGTH = 4     # ... this many tokens
PROBE_SHARE = 0.05   # in a batch, probes take at most about this share of the batch's time (probe_interval)


def probe_interval(cost, probe_s: float) -> int:
    """Rounds between probes (a round that drafts although drafting did not pay, to see whether it pays again)
    for a generation whose probe costs `probe_s` seconds of proposing: alone PROBE_ROUNDS. In a batch every
    generation's proposing delays the shared forward, so with L generations each probing every P rounds a
    forward waits L * probe_s / P seconds for probes on average: P is raised until that is at most PROBE_SHARE
    of the forward (L counted as one plus the others' width, an upper bound). Without it a batch of 8
    generations of d3d-tree ran about one drafter pass per forward, each costing more than the forward."""
    width = cost.others()[0]
    if width == 0:
        return PROBE_ROUNDS
    return max(PROBE_ROUNDS, math.ceil((1 + width) * probe_s / (PROBE_SHARE * cost(width + 1))))


class DraftLength:
    def __init__(self, cost, max_len: int):
        self.cost, self.max_len = cost, max_len
        self.counts = [list(PRIOR) for _ in range(max_len)]
        self.propose_s, self.plain_rounds, self.t0 = 0.0, 0, 0.0

    def choose(self, k: int) -> int:
        """The draft length for this round, at most k."""
        others = self.cost.others()
        if others[0] == 0 or k <= 0:
            return k
        gain, reach, best, best_rate = 1.0, 1.0, 0, self.cost.rate(1.0, 1, others)
        for j in range(min(k, self.max_len)):
            right, tried = self.counts[j]
            reach *= right / tried
            gain += reach
            rate = self.cost.rate(gain, j + 2, others, self.propose_s)  # the pending token and j + 1 drafts
            if rate > best_rate:
                best, best_rate = j + 1, rate
        if best == 0 and self.plain_rounds >= probe_interval(self.cost, self.propose_s):
            best = min(k, PROBE_LENGTH)
        self.plain_rounds = 0 if best else self.plain_rounds + 1
        return best

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def drafted(self) -> None:
        """The proposer has drafted (start() was called before it)."""
        self.propose_s += 0.2 * (time.perf_counter() - self.t0 - self.propose_s)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified round: `accepted` of `drafted` drafts were accepted (a prefix)."""
        for j in range(min(drafted, accepted + 1, self.max_len)):
            right, tried = self.counts[j]
            self.counts[j] = [DECAY * right + (j < accepted), DECAY * tried + 1]
