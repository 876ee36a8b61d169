"""The width of d3d-tree's trees: the measured cost of a target forward versus how many tokens it
feeds, the budget that cost allows, and the width that maximises expected tokens per second."""
from __future__ import annotations

import time

import torch

from .engine import sync_device
from ..errors import D3DError
from ..methods.d3d import D3DProposer

WIDTHS = (1, 2, 4, 8, 16, 32, 64)


@torch.no_grad()
def width_cost_curve(model, widths: tuple[int, ...] = WIDTHS, context: int = 256, repeats: int = 5) -> dict[int, float]:
    """Seconds of one target forward feeding `width` tokens after a cache of `context` tokens, for each
    width: the fastest of `repeats` runs (interference from other work only ever adds time), the widths
    taking turns so that a busy spell slows them all alike. As in decoding, where a round's width is close
    to the last one's, each timed forward follows an untimed one of the same width, the widths go up
    within a turn, and a turn starts with a few narrowest forwards: for a few forwards after a wide one a
    narrow one is slower (measured: an int8 SmolLM2 token 6.5 ms after others like it, 8-11 ms when every
    width up to 64 took its turn in between, which made trees look cheaper than they are). Every forward
    is rolled back, so the cache only ever holds the context."""
    device = next(model.parameters()).device
    model.setup_cache(1, context + max(widths) + 1)
    model(torch.zeros(1, context, dtype=torch.long, device=device))
    widths = tuple(sorted(widths))
    times: dict[int, list[float]] = {w: [] for w in widths}

    def forward(w: int) -> float:
        t0 = time.perf_counter()
        model(torch.zeros(1, w, dtype=torch.long, device=device))
        sync_device(device)
        seconds = time.perf_counter() - t0
        model.rollback(context)
        return seconds

    for _ in range(repeats):
        for _ in range(3):
            forward(widths[0])
        for w in widths:
            forward(w)
            times[w].append(forward(w))
    return {w: min(t) for w, t in times.items()}


def measured_curve(model) -> dict[int, float] | None:
    """width_cost_curve of `model`, measured once per model and thread count (a few seconds on a CPU) and
    shared by the methods built on it; None where the model's context is too short to measure it."""
    threads = torch.get_num_threads()
    cached = getattr(model, "_d3d_width_curve", None)
    if cached is not None and cached[0] == threads:
        return cached[1]
    args = getattr(model, "args", None)
    room = getattr(args, "max_seq_len", 4096) - max(WIDTHS) - 1
    if room < 16:
        return None
    curve = width_cost_curve(model, context=min(256, room))
    model._d3d_width_curve = (threads, curve)
    return curve


class WidthCost:
    """Seconds of a target forward by width (linear between measured widths), and the width that
    maximises expected tokens per second of a round.

    load: for a generation in a batch (d3d.scheduler.SlotModel.batch_load), () -> (width, committed tokens)
    of the other generations' forwards; a round's width is then the one that maximises the whole batch's
    committed tokens per second of the shared forward."""

    def __init__(self, curve: dict[int, float], overhead: float = 0.0, load=None):
        self.widths = sorted(curve)
        self.curve, self.overhead, self.load = monotone(curve), overhead, load
        self.table = [self.interpolate(w) for w in range(max(self.widths) + 1)]  # best_width calls it per node

    def __call__(self, width: int) -> float:
        return self.table[width] if 0 <= width < len(self.table) else self.interpolate(width)

    def interpolate(self, width: int) -> float:
        ws = self.widths
        lo = max([w for w in ws if w <= width], default=ws[0])
        hi = min([w for w in ws if w >= width], default=ws[-1])
        if lo == hi:
            lo, hi = (ws[-2], ws[-1]) if width > ws[-1] else (lo, hi)
        if lo == hi:
            return self.curve[lo]
        return self.curve[lo] + (width - lo) * (self.curve[hi] - self.curve[lo]) / (hi - lo)

    def rate(self, gain: float, width: int, others: tuple[int, float] = (0, 0.0), extra: float = 0.0) -> float:
        """Expected committed tokens per second of a round that feeds `width` tokens and expects `gain`
        tokens, beside `others` = (width, tokens) of the rest of its batch: all of the forward's tokens over
        its cost. overhead: the round's other costs (drafting); extra: seconds more (a proposer's own time)."""
        return (gain + others[1]) / (self(others[0] + width) + self.overhead + extra)

    def step_token_s(self, others: tuple[int, float] = (0, 0.0)) -> float:
        """Seconds a token of a plain step (the pending token alone) costs beside `others`: the shared forward
        over all of its tokens (alone, a one-token forward)."""
        return self(others[0] + 1) / (1 + others[1])

    def others(self) -> tuple[int, float]:
        return self.load() if self.load is not None else (0, 0.0)

    def best_width(self, scores: list[float]) -> int:
        """Nodes sorted by score (the chance that verification reaches them): the tree width T (root
        included) maximising (1 + sum of the first T - 1 scores) / (cost(T) + overhead), i.e. expected
        tokens of the round per second (in a batch: of the batch's forward, `rate`)."""
        best, best_rate, gain, others = 1, 0.0, 1.0, self.others()
        for t in range(1, len(scores) + 2):
            if t > 1:
                gain += scores[t - 2]
            rate = self.rate(gain, t, others)
            if rate > best_rate:
                best, best_rate = t, rate
        return best


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The curve made non-decreasing in width (a running maximum): a wider forward that measured faster
    than a narrower one did so by noise."""
    out, top = {}, 0.0
    for w in sorted(curve):
        top = max(top, curve[w])
        out[w] = top
    return out


def choose_budget(curve: dict[int, float], base: int = 16, max_ratio: float = 1.25) -> int:
    """The widest measured forward that costs at most `max_ratio` times a plain block of `base` tokens:
    beyond it, extra candidates would have to raise tau by more than the forward's extra cost."""
    if base not in curve:
        raise D3DError(f"the cost curve has no width {base}")
    curve = monotone(curve)
    limit = max_ratio * curve[base]
    return max(w for w, s in curve.items() if w <= base or s <= limit)


@torch.no_grad()
def drafter_costs(proposer: D3DProposer, slots: list[int | None], context: int = 256, repeats: int = 5
                  ) -> dict[int | None, float]:
    """Seconds of one synchronous D3D draft of each number of `slots` (None: the whole block) after
    `context` tokens, one new token per draft as in a round: the fastest of `repeats`, the options
    taking turns (as in width_cost_curve)."""
    d = proposer.drafter
    d.setup_cache(1, context + d.block_size + 2)
    d.cached_tokens = []
    text = [0] * context
    d.draft_block(text)
    times: dict[int | None, list[float]] = {s: [] for s in slots}
    for i in range(repeats):
        for j, s in enumerate(slots):
            text[-1] = 1 + (i * len(slots) + j) % 2  # the last token changes: every draft feeds it again
            t0 = time.perf_counter()
            d.draft_block(text, s)
            sync_device(d.draft_ids.device)
            times[s].append(time.perf_counter() - t0)
    return {s: min(t) for s, t in times.items()}


def slot_options(block_size: int) -> list[int]:
    """The drafting passes whose cost is measured (drafter_costs): 2, 4, 8, ... slots, and the whole block."""
    return sorted({min(2 ** i, block_size) for i in range(1, block_size.bit_length() + 1)})


def choose_slots(proposer: D3DProposer, max_ratio: float = 1.25) -> tuple[int, float, float]:
    """(slots, seconds a draft of them costs, seconds each further token fed adds): the most slots (of 2, 4,
    8, ..., the block) whose drafting pass costs at most `max_ratio` times a 2-slot pass. Acceptance lives in
    a drafter's first few slots, so where the pass is bound by reading the drafter's weights (a GPU, or a few
    slots on a CPU) the whole block comes for free, and where each slot adds compute (more than a few on a
    CPU) the extra slots would cost more than they win. The cost of a token, from the narrowest and widest
    passes (a mask slot costs what a text token does), prices a drafter that has verified text to catch up on
    (TreeProposer.drafting_pays): on the fp32 pair's 0.5B drafter on 2 cores 5 ms, so 64 tokens behind, a
    pass costs 0.38 s instead of 0.06 s."""
    B = proposer.drafter.block_size
    options = slot_options(B)
    costs = drafter_costs(proposer, options)
    best = max(s for s in options if costs[s] <= max_ratio * costs[options[0]])
    token_s = max(0.0, costs[B] - costs[options[0]]) / max(1, B - options[0])
    return best, costs[best], token_s
