"""What the generation worker tells a request's handler, in order: a Round per verification round (only for
streamed requests), then one of Done, Failed or Stopped. Put on the job's asyncio queue from the worker
thread (Job.emit); the request's disconnect watcher and queue deadline add Stopped themselves."""
from __future__ import annotations

from dataclasses import dataclass

from .requests import ApiError


@dataclass(frozen=True)
class Round:
    ids: list[int]            # the round's tokens
    accepted: int             # of which accepted drafts (the rest: the target's own token)
    t: float                  # time.perf_counter() when the round ended
    segments: list[tuple[str, bool]]  # the round's new text as (text, is accepted draft) pieces
    logprobs: dict | None     # the round's tokens' logprobs, OpenAI-shaped, if asked for
    branch: str | None        # d3d-tree, lookup-tree: the proposer(s) of the accepted path


@dataclass(frozen=True)
class Done:
    result: object            # the GenerationResult
    tail: str                 # streamed requests: text held back until the end (stop strings)
    logprobs: dict | None     # plain requests: every token's logprobs, if asked for
    cached_tokens: int = 0    # prompt tokens whose K/V were already in the request's batch slot (d3d.scheduler)


@dataclass(frozen=True)
class Failed:
    error: ApiError


@dataclass(frozen=True)
class Stopped:
    reason: str               # "cancelled" (by the worker), "disconnected" (the client left), "expired" (queue deadline)


Event = Round | Done | Failed | Stopped
