"""How many drafts a generation verifies per round. In a batch (d3d.scheduler) every extra token widens a forward
that the other generations wait for, so the draft is cut to the length that gives the batch the most committed
tokens per second, and to nothing where drafting does not pay at all. Alone, a proposer that knows what a draft of
each length costs it (`d3d`: a drafting pass of fewer slots is cheaper) is sized the same way against the target's
forward alone: on a CPU a verification of 16 rows costs several times one row (the int4 pair: 122 ms against
35 ms), so with tau near 4 a block verified whole spends most of its forward on drafts that are rejected. Other
proposers alone verify their whole draft, as they always did.

The choice uses the measured width cost curve (d3d.decoding.treecost.WidthCost), the other generations' last
forward (SlotModel.batch_load; none alone), this generation's acceptance rate per draft position (decayed counts,
from verified rounds only) and the seconds its proposer takes per round (in a batch the generations' Python and
drafter work runs one after the other, so it delays every forward; alone, the measured cost of a draft of that
length where the proposer has one). It is fixed before the round from earlier rounds, so sampling stays exact.
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
    """draft_s: seconds a draft of n tokens costs the proposer (alone), or None: in a batch only, with the
    proposer's measured seconds per round."""

    def __init__(self, cost, max_len: int, draft_s=None):
        self.cost, self.max_len, self.draft_s = cost, max_len, draft_s
        self.counts = [list(PRIOR) for _ in range(max_len)]
        self.propose_s, self.plain_rounds, self.t0 = 0.0, 0, 0.0

    def choose(self, k: int) -> int:
        """The draft length for this round, at most k."""
        others = self.cost.others()
        if (others[0] == 0 and self.draft_s is None) or k <= 0:
            return k
        gain, reach, best, best_rate = 1.0, 1.0, 0, self.cost.rate(1.0, 1, others)
        for j in range(min(k, self.max_len)):
            right, tried = self.counts[j]
            reach *= right / tried
            gain += reach
            extra = self.propose_s if self.draft_s is None else self.draft_s(j + 1)
            rate = self.cost.rate(gain, j + 2, others, extra)  # the pending token and j + 1 drafts
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
