"""`d3d serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) around one Generator.

Modules: requests (parsing bodies into GenRequest, OpenAI-style errors), streaming (text deltas and
logprobs), worker (the generation thread and its queue) and events (what it reports), completions (the
completion endpoints: body, queue, answer), shaping (OpenAI bodies and SSE chunks), metrics (Prometheus),
security (the Guard middleware), app (routes and start-up).

Endpoints: GET / (a web page showing drafting live), GET /health, GET /v1/models,
POST /v1/chat/completions, POST /v1/completions (plain JSON or server-sent events), GET /metrics
(Prometheus text format).

Security (the Guard middleware, before any endpoint runs): the Host header must name this server
(loopback names, the --host address, --allow-host names; else 421: DNS rebinding); with an API key
(blank keys refused at start-up, stripped on both sides) every path but /health needs
`Authorization: Bearer KEY` (or HTTP Basic with KEY as the password, for the web page); a request with
an `Origin` header must come from the server's own origin (or one given with --allow-origin); a POST
must be `Content-Type: application/json`. Bodies are read in pieces and refused (413) past 4 MB.
Before the queue (app.server_config, completions.read_body): a connection limit, a deadline for headers (the
connection is closed) and for the body (408), bounded body bytes in flight and parse backlog (503), a
prompt-token cap and a character cap checked before tokenizing (400); chat content spelling a special
token is refused (400).

Concurrency: one model, one generation worker thread, a bounded FIFO queue in front of it. A request
that finds `max_queue` requests already waiting behind the running one gets 503. Each request has a
task that waits for the client's disconnect (streaming or not): the request is then dropped from the
queue, or its generation stopped at the next round (the engine's on_round callback raises), so its
slot frees at once. Prompts are processed in chunks (worker.ChunkedPrefill) with the same checks
between chunks, so a long prompt cannot hold the worker past a disconnect or a deadline. With a
request timeout, a request still queued at its deadline gets 504 and a running one is cut at the next
round (finish_reason "length", d3d.finish_reason "timeout"), or answered 504 if still in its prompt.
Tokenisation runs in a helper thread, text decoding and stop handling in the worker thread, so the
event loop never does work that grows with a request's size.

What requests share: one Generator, so with lookup-tree, d3d-tree and suffix (unless started with
--no-learn), every finished answer joins the method's store of earlier generations (at most
--learn-tokens tokens, the oldest dropped first) and later requests draft from it. Only drafts: every
answer is the target's own either way; but how fast a request decodes can depend on what earlier
requests generated, which a client could time, so a server shared by clients who must not learn
anything about each other's requests should run with --no-learn.

Streamed chunks carry, besides the OpenAI fields, a `d3d` object per round: `accepted` (draft tokens
accepted in the round), `tokens` (the round's token ids), `segments` (the round's text split into
`{"text", "draft": bool}` pieces: accepted drafts vs the target's own token), running `tau` and
`tokens_per_s`, and with d3d-tree and lookup-tree `branch` (the proposer(s) of the accepted path: d3d,
alt, ngram, datastore, learned (earlier answers), joined by + when they agree). The web page uses it; OpenAI clients ignore it.
"""
from .app import check_address, create_app, serve
from .streaming import TextStreamer

__all__ = ["check_address", "create_app", "serve", "TextStreamer"]
