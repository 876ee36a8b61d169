"""The packed pass of asynchronous D3D: every successor block drafted in one drafter forward.

While the target verifies V = [v0 .. v(m-1)] (v0 = the pending token, v1.. = drafts), the drafter's
cache holds the verified context before V (L tokens, positions 0..L-1). One forward then feeds

    V                              causally, at positions L .. L+m-1 (its K/V are kept)
    candidate a, for a in C        S mask slots at positions L+a+1 .. L+a+S

Candidate a is the block the drafter would draft synchronously after the context ctx + V[0..a]: its
slots see the cache, V[0..a] and each other (bidirectionally), never V[a+1..] nor another candidate.
When the target accepts a drafts, slot 0 of candidate a sits on the bonus position (the bonus replaces
it) and slots 1..S-1 are the next drafts. Only V's K/V stay in the cache; the caller rolls back to
L + a + 1, so the bonus enters the cache as v0 of the next packed pass.

With token shift (drafter.cfg.shift) candidate a feeds only S - 1 masks, at L+a+1 .. L+a+S-1: its slot 0
is V[a]'s own causal state (which predicts the bonus position), slot k >= 1 the mask at L+a+k, so the
slots mean the same as without shift.
"""
from __future__ import annotations

import torch

from ..drafters.drafter import Drafter


def packed_layout(L: int, m: int, candidates: list[int], slots: int,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [T], mask [T, L + T]) of the packed input: V (m tokens) then one block of `slots`
    masks per candidate, T = m + len(candidates) * slots. mask[q, j] = True when query q sees key j."""
    if any(not 0 <= a < m for a in candidates):
        raise ValueError(f"acceptance counts {candidates} out of range for a block of {m} tokens")
    S, T = slots, m + len(candidates) * slots
    positions = torch.empty(T, dtype=torch.long)
    positions[:m] = torch.arange(L, L + m)
    mask = torch.zeros(T, L + T, dtype=torch.bool)
    mask[:, :L] = True
    mask[:m, L:L + m] = torch.ones(m, m, dtype=torch.bool).tril()
    for i, a in enumerate(candidates):
        q = m + i * S
        positions[q:q + S] = torch.arange(L + a + 1, L + a + 1 + S)
        mask[q:q + S, L:L + a + 1] = True
        mask[q:q + S, L + q:L + q + S] = True
    return positions.to(device), mask.to(device)


def packed_input(drafter: Drafter, L: int, V: list[int], candidates: list[int] | None = None,
                 slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [1, T], positions [T], mask [T, L + T]) for the packed pass after L cached tokens.
    candidates default to every acceptance count 0..len(V)-1; slots default to the drafter's block size
    (one mask fewer per candidate with token shift)."""
    cands = list(range(len(V))) if candidates is None else list(candidates)
    S = drafter.mask_slots(slots)
    device = drafter.draft_ids.device
    tokens = torch.tensor([list(V) + [drafter.mask_id] * (len(cands) * S)], device=device)
    positions, mask = packed_layout(L, len(V), cands, S, device)
    return tokens, positions, mask


@torch.no_grad()
def packed_draft(drafter: Drafter, V: list[int], candidates: list[int] | None = None, slots: int | None = None,
                 apply_head: bool = True) -> torch.Tensor:
    """Run the packed pass on a drafter whose cache holds the context before V.

    Returns per-candidate logits [len(candidates), S, V_draft], or with apply_head=False the final
    hidden states [len(candidates), S, dim], so that the LM head (the largest matmul of a packed pass
    over a big vocabulary) is paid only for the candidate the target picks: `drafter.head(h[i])`.
    Afterwards the cache holds context + V (cached_tokens too); roll back to L + a + 1.
    """
    L = drafter.cache_len
    if len(drafter.cached_tokens) != L:
        raise ValueError(f"drafter cache holds {L} positions but {len(drafter.cached_tokens)} cached tokens")
    cands = list(range(len(V))) if candidates is None else list(candidates)
    S = slots or drafter.block_size
    tokens, positions, mask = packed_input(drafter, L, V, cands, S)
    x, _ = drafter.hidden(tokens, mask=mask, positions=positions)
    drafter.cache_len = L + len(V)
    drafter.cached_tokens += list(V)
    h = x[0, len(V):].view(len(cands), drafter.mask_slots(S), -1)
    if drafter.cfg.shift:
        h = torch.cat([x[0, cands][:, None], h], dim=1)
    return drafter.head(h) if apply_head else h


def keep_prefix(drafter: Drafter, n: int) -> None:
    """Keep the first n cached tokens (K/V and ids): after a packed pass, n = L + accepted + 1."""
    drafter.rollback(n)
    del drafter.cached_tokens[n:]


def acceptance_law(confidences: list[float]) -> list[float]:
    """P(a accepted drafts), a = 0..k, if draft i is accepted independently with probability
    confidences[i] (the drafter's own probability of its token): a proxy for where a rejection lands."""
    law, alive = [], 1.0
    for c in confidences:
        law.append(alive * (1.0 - c))
        alive *= c
    return law + [alive]


def likely_candidates(confidences: list[float], n: int) -> list[int]:
    """The n most likely acceptance counts under `acceptance_law`, ascending."""
    law = acceptance_law(confidences)
    return sorted(sorted(range(len(law)), key=lambda a: -law[a])[:n])
