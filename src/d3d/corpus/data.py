"""Self-distillation data: the target's own greedy responses to training prompts.

Layout of a dataset folder:
  manifest.json             sources, settings, shard list and token counts
  shard_00000.npz           prompt/response token ids (uint32 flat arrays + offsets) and prompt hashes
Shard i always covers prompts [i * shard_size, (i + 1) * shard_size) of the deterministic training
mix (or code mix), so a killed run resumes at the first missing shard; every file is written atomically.
"""
from __future__ import annotations

import json
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..atomic import atomic_write_bytes, atomic_write_json
from ..runtime.batch import BatchedTarget, Segment, runs_natively
from .code_prompts import code_mix, python_version
from ..errors import D3DError, first_line
from .prompts import chat_mix, encode_prompt, prompt_hash, training_mix

PROMPT_SETS = {
    "mix": "interleaved mix of gsm8k-train, math-train, sharegpt first turns; benchmark test prompts removed "
           "(prompts.training_mix)",
    "code": "interleaved sharegpt first turns that mention code (positions training_mix never uses, before the "
            "held-out pool) and python standard-library function stubs; benchmark and training_mix prompts "
            "removed (code_prompts.code_mix)",
    "chat": "sharegpt first turns that do not mention code (positions training_mix never uses, before the "
            "held-out pool); benchmark, training_mix and held-out prompts removed (prompts.chat_mix)",
}
PROMPT_MIXES = {"mix": training_mix, "code": code_mix, "chat": chat_mix}


def _flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.uint32, count=int(offsets[-1]))
    return flat, offsets


def _unflat(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [flat[offsets[i]:offsets[i + 1]].astype(np.int64).tolist() for i in range(len(offsets) - 1)]


def save_shard(path: Path, prompts: list[list[int]], responses: list[list[int]], hashes: list[str],
               sources: list[str]) -> None:
    import io

    pf, po = _flat(prompts)
    rf, ro = _flat(responses)
    buf = io.BytesIO()
    np.savez_compressed(buf, prompt_ids=pf, prompt_offsets=po, response_ids=rf, response_offsets=ro,
                        hashes=np.array(hashes), sources=np.array(sources))
    atomic_write_bytes(path, buf.getvalue())


@dataclass
class Example:
    prompt_ids: list[int]
    response_ids: list[int]
    source: str
    hash: str


def read_manifest(folder: Path) -> dict:
    """A dataset folder's manifest.json, or a one-line D3DError naming it."""
    path = Path(folder) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest.get("shards"), list):
            raise ValueError("no shard list")
    except (OSError, ValueError, AttributeError) as e:
        raise D3DError(f"{path} is not a d3d dataset manifest ({first_line(e)})") from None
    return manifest


def load_dataset(folder: str | Path, max_shards: int | None = None) -> list[Example]:
    """All examples of a dataset folder, or of its first `max_shards` shards (a fixed, smaller budget); a
    truncated or damaged shard is a one-line D3DError naming it."""
    folder = Path(folder)
    out = []
    for shard in read_manifest(folder)["shards"][:max_shards]:
        path = folder / shard["file"]
        try:
            z = np.load(path)
            prompts = _unflat(z["prompt_ids"], z["prompt_offsets"])
            responses = _unflat(z["response_ids"], z["response_offsets"])
            sources, hashes = z["sources"].tolist(), z["hashes"].tolist()
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise D3DError(f"{path} is not a d3d data shard, or is truncated ({first_line(e)})") from None
        out += [Example(p, r, s, h) for p, r, s, h in zip(prompts, responses, sources, hashes)]
    return out


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> list[list[int]]:
    """Responses for a batch of prompts, greedy (temperature 0) or sampled: generate_in_slots where the C++
    layers run and the answers are greedy, else generate_padded."""
    if temperature == 0 and runs_natively(model):
        return generate_in_slots(model, prompts, max_new_tokens, eos_ids)
    return generate_padded(model, prompts, max_new_tokens, eos_ids, temperature, generator)


def generate_padded(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], temperature: float = 0.0,
                    generator: torch.Generator | None = None) -> list[list[int]]:
    """generate_batch on the PyTorch layers (any device): left padding, pad keys masked, per-row rotary
    positions; each step's tokens reach the host in one copy. Rows that finish are compacted out of the batch
    (KV cache included) once fewer than 3/4 are live, so the cost follows the live rows."""
    device = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros(B, P, dtype=torch.long)
    valid = torch.zeros(B, P + max_new_tokens, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):] = torch.tensor(p)
        valid[i, P - len(p):] = True
    valid[:, P:] = True
    tokens, valid = tokens.to(device), valid.to(device)
    model.setup_cache(B, P + max_new_tokens)
    pos = valid[:, :P].long().cumsum(-1) - 1
    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    mask = (causal[None] & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=device)  # pads see themselves
    logits = model(tokens, mask=mask[:, None], positions=pos.clamp(min=0), last_only=True)[:, -1]
    rows, out, done = list(range(B)), [[] for _ in range(B)], [False] * B
    next_pos = pos[:, -1] + 1
    for step in range(max_new_tokens):
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1)
        for r, t in zip(rows, nxt.tolist()):
            if not done[r]:
                out[r].append(t)
                done[r] = t in eos_ids
        live = [j for j, r in enumerate(rows) if not done[r]]
        if not live or step == max_new_tokens - 1:
            break
        if len(live) < len(rows) * 3 // 4:
            keep = torch.tensor(live, device=device)
            for layer in model.layers:
                layer.attention.k_cache = layer.attention.k_cache[keep].contiguous()
                layer.attention.v_cache = layer.attention.v_cache[keep].contiguous()
            model.max_batch = len(live)
            rows, nxt, valid, next_pos = [rows[j] for j in live], nxt[keep], valid[keep], next_pos[keep]
        L = model.cache_len
        logits = model(nxt[:, None], mask=valid[:, None, None, :L + 1], positions=next_pos[:, None],
                       last_only=True)[:, -1]
        next_pos = next_pos + 1
    return out


def generate_in_slots(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int],
                      prefill_rows: int = 2048) -> list[list[int]]:
    """Greedy responses on the C++ layers' batched forward (d3d.runtime.batch): each prompt in a cache slot of
    its own, the prompts read a few at a time (at most `prefill_rows` rows a forward), then one forward a step
    over every answer still running. A row's sums do not depend on its batch, so each answer is token for token
    what plain decoding (`ar`) gives its prompt alone. Against the PyTorch layers' padded batch (16 prompts, 2
    threads, AVX-512 EPYC): SmolLM2 in fp32 2.0x the tokens a second, the pair in fp32 1.5x (its forwards are
    compute-bound on two cores either way); the pair in int4 makes 70-95 tokens a second."""
    from ..decoding.verify import greedy_tokens

    batch = BatchedTarget(model, len(prompts), max(len(p) for p in prompts) + max_new_tokens + 1)
    try:
        firsts: list[int] = []
        group: list[Segment] = []
        for i, p in enumerate(prompts):
            group.append(Segment(i, torch.tensor(p), 0, torch.arange(len(p)), keep=1))
            if i == len(prompts) - 1 or sum(s.width for s in group) + len(prompts[i + 1]) > prefill_rows:
                firsts += [greedy_tokens(row[-1]) for row in batch.forward(group)]
                group = []
        lengths = [len(p) for p in prompts]
        out = [[t] for t in firsts]
        live = [i for i, t in enumerate(firsts) if t not in eos_ids]
        for _ in range(max_new_tokens - 1):
            if not live:
                break
            rows = batch.forward([Segment(i, torch.tensor(out[i][-1:]), lengths[i], torch.tensor([lengths[i]]))
                                  for i in live])
            for i, row in zip(live, rows):
                lengths[i] += 1
                out[i].append(greedy_tokens(row[-1]))
            live = [i for i in live if out[i][-1] not in eos_ids]
        return out
    finally:
        batch.release()


def dataset_manifest(out: Path, target_name: str, max_new_tokens: int = 256, max_prompt_tokens: int = 384,
                     shard_size: int = 128, seed: int = 0, prompts: str = "mix", quantize: str | None = None) -> dict:
    """The manifest to extend in the dataset folder `out` (a new one if it holds none), or a D3DError if
    its data was made with other settings (`d3d data` asks before loading the target). quantize: the target's
    weights (None: fp32), so that one folder never mixes the answers of two precisions."""
    settings = {"target": target_name, "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
                "shard_size": shard_size, "seed": seed, "decoding": "greedy", "chat_template": True}
    if prompts not in PROMPT_SETS:
        raise D3DError(f"unknown prompt set {prompts!r}; choose from {', '.join(PROMPT_SETS)}")
    if prompts != "mix":  # the main mix's folders predate the field
        settings["prompts"] = prompts
    if quantize is not None:  # the fp32 folders predate the field
        settings["quantize"] = quantize
    if prompts == "code":
        settings["python"] = python_version()
    manifest = read_manifest(out) if (out / "manifest.json").exists() else {"settings": settings, "shards": []}
    if manifest.get("settings") != settings:
        raise D3DError(f"{out} was built with other settings: {manifest.get('settings')}; use another --out")
    return manifest


def build_dataset(model, tokenizer, out: Path, target_name: str, max_tokens: int, max_new_tokens: int = 256,
                  max_prompt_tokens: int = 384, batch_size: int = 32, shard_size: int = 128, seed: int = 0,
                  prompts: str = "mix", log=None, quantize: str | None = None) -> dict:
    """Generate shards until `max_tokens` response tokens exist (resuming from what is on disk).

    prompts: "mix" (training_mix: GSM8K/MATH train and ShareGPT, interleaved), "code" (code_mix: code
    requests and standard-library function stubs that the mix never uses) or "chat" (chat_mix: ShareGPT
    requests that neither uses); one set per folder. quantize: the precision `model` was loaded in.
    """
    out.mkdir(parents=True, exist_ok=True)
    mpath = out / "manifest.json"
    manifest = dataset_manifest(out, target_name, max_new_tokens, max_prompt_tokens, shard_size, seed, prompts, quantize)
    manifest["sources"] = PROMPT_SETS[prompts]
    mix = PROMPT_MIXES[prompts](seed)
    eos = {tokenizer.eos_token_id}
    total = sum(s["response_tokens"] for s in manifest["shards"])
    bar = tqdm(total=max_tokens, initial=min(total, max_tokens), unit="tok", desc="distill", mininterval=5)
    shard_idx = len(manifest["shards"])
    while total < max_tokens and shard_idx * shard_size < len(mix):
        t0 = time.time()
        items = mix[shard_idx * shard_size:(shard_idx + 1) * shard_size]
        encoded = [(s, p, encode_prompt(tokenizer, p)) for s, _, p in items]
        encoded = [e for e in encoded if len(e[2]) <= max_prompt_tokens]
        encoded.sort(key=lambda e: len(e[2]))
        responses = []
        for b in range(0, len(encoded), batch_size):
            chunk = encoded[b:b + batch_size]
            responses += generate_batch(model, [e[2] for e in chunk], max_new_tokens, eos)
            bar.update(sum(len(r) for r in responses[-len(chunk):]))
        n = sum(len(r) for r in responses)
        name = f"shard_{shard_idx:05d}.npz"
        save_shard(out / name, [e[2] for e in encoded], responses, [prompt_hash(e[1]) for e in encoded],
                   [e[0] for e in encoded])
        manifest["shards"].append({"file": name, "examples": len(encoded), "response_tokens": n,
                                   "seconds": round(time.time() - t0, 1)})
        manifest["response_tokens"] = total = total + n
        manifest["examples"] = sum(s["examples"] for s in manifest["shards"])
        atomic_write_json(mpath, manifest)
        if log:
            log(f"shard {shard_idx}: {len(encoded)} examples, {n} tokens, {n / (time.time() - t0):.0f} tok/s, "
                f"total {total}")
        shard_idx += 1
    bar.close()
    return manifest
