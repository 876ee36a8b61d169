"""Progressive layer pruning of a drafter by its effect on acceptance length (`d3d prune`).

A packed pass of asynchronous D3D costs about B plain drafts, so every drafter layer weighs more than it
would in DFlash. Following the paper, layers are removed one at a time: at each step every remaining
layer is bypassed in turn (its residual branch skipped, so the stream passes straight through), the
acceptance length tau is re-measured on calibration sets with the replay estimator (d3d.training.estimate: no
target forward), and the layer whose removal costs least goes, optionally followed by a short healing
fine-tune. Pruning stops when the best removal (healed, if healing is on) would fall below `keep_ratio`
of the starting mean tau, or when a layer budget is reached.

Calibration continuations are the target's greedy outputs, generated once and cached in the run folder;
after every step the pruned drafter and a state file are written atomically, so a killed run resumes.

With `twin` (`d3d prune --quantize int4`) the trials and timings run on a quantized copy of the drafter, as it
decodes beside a quantized target, while removals and the saved drafter stay on the fp32 weights: on the pair's
drafter a trial takes 31-46 s in int4, a 24-trial step 14 minutes and 11 GB resident, against 40-90 minutes and
14.8 GB with the fp32 pair.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import fields, replace
from pathlib import Path

import torch
from tqdm import tqdm

from .batches import TrainConfig
from ..atomic import atomic_write_json
from ..drafters.drafter import Drafter, bypassed
from ..drafters.kinds import get_kind
from ..drafters.files import WEIGHTS_NAME, save_drafter
from .estimate import mean_tau
from ..decoding.packed import keep_prefix, packed_draft

Calibration = dict[str, tuple[list[list[int]], list[list[int]]]]  # set name -> (prompt ids, continuations)


def remove_layers(drafter: Drafter, drop: set[int] | list[int]) -> Drafter:
    """A new drafter without the stack layers `drop` (config and init_layers updated)."""
    keep = [i for i in range(len(drafter.layers)) if i not in set(drop)]
    init = drafter.cfg.init_layers
    cfg = replace(drafter.cfg, args=drafter.cfg.args | {"n_layers": len(keep)},
                  init_layers=[init[i] for i in keep] if len(init) == len(drafter.layers) else [],
                  from_target=[keep.index(i) for i in drafter.cfg.from_target if i in keep])
    state = {}
    for k, v in drafter.state_dict().items():
        if "cache" in k:
            continue
        if k.startswith("layers."):
            i, rest = k.split(".", 2)[1:]
            if int(i) not in keep:
                continue
            k = f"layers.{keep.index(int(i))}.{rest}"
        state[k] = v.clone()
    device = drafter.draft_ids.device
    with torch.device("meta"):
        d = get_kind(cfg.kind).model_class()(cfg)
    d.load_state_dict(state, strict=True, assign=True)
    d.inv_freq = drafter.inv_freq.clone()
    return d.to(device).eval().requires_grad_(False)


def calibration_data(model, tokenizer, sets: list[str], n: int, max_new_tokens: int,
                     cache: Path | None = None) -> Calibration:
    """The target's greedy continuations of `n` calibration prompts per set (d3d.corpus.prompts), cached in
    `cache` so that a second call or a resumed run costs nothing."""
    from .estimate import greedy_continuations
    from ..corpus.prompts import calibration_prompts

    texts = {s: calibration_prompts(s, n) for s in sets}
    conts = greedy_continuations(model, tokenizer, texts, max_new_tokens, cache, desc="calibration")
    return {s: ([p for p, _ in rows], [c for _, c in rows]) for s, rows in conts.items()}


def calibration_tau(drafter: Drafter, calib: Calibration, max_new_tokens: int) -> dict[str, float]:
    """Estimated tau per calibration set, plus their unweighted mean under "mean"."""
    taus = {s: round(mean_tau(drafter, p, c, max_new_tokens), 4) for s, (p, c) in calib.items()}
    taus["mean"] = round(statistics.fmean(taus.values()), 4)
    return taus


@torch.no_grad()
def draft_times(drafter: Drafter, context: list[int], reps: int = 5) -> dict[str, float]:
    """Median ms of a synchronous draft (2 new context tokens + B masks) and of a full packed pass
    (B verified tokens, B candidates of B slots, no LM head) after `context`."""
    B = drafter.block_size
    drafter.setup_cache(1, len(context) + B * (B + 1) + 8)
    drafter.cached_tokens = []
    drafter.draft_block(context[:-2])
    sync, packed = [], []
    for _ in range(reps):
        drafter.sync_context(context[:-2])
        t0 = time.perf_counter()
        drafter.draft_block(context)
        sync.append(time.perf_counter() - t0)
        drafter.sync_context(context)
        t0 = time.perf_counter()
        packed_draft(drafter, context[-B:], apply_head=False)
        packed.append(time.perf_counter() - t0)
        keep_prefix(drafter, len(context))
    return {"draft_ms": round(1000 * statistics.median(sync), 2),
            "packed_ms": round(1000 * statistics.median(packed), 2)}


def heal_config(drafter: Drafter, steps: int, lr: float) -> TrainConfig:
    """The fine-tune after a removal continues the drafter's own recorded objective (gamma, lambda, blocks,
    batch size, seed), for `steps` at `lr` without warm-up or LayerDrop. A drafter with no record gets
    TrainConfig's defaults."""
    known = {f.name for f in fields(TrainConfig)}
    recorded = {k: v for k, v in drafter.cfg.training.get("config", {}).items() if k in known}
    return TrainConfig(**recorded | {"steps": steps, "lr": lr, "warmup": 0, "checkpoint_every": 10**9,
                                     "layer_drop": 0.0})


def prune(drafter: Drafter, calib: Calibration, max_new_tokens: int, run_dir: Path, keep_ratio: float = 0.99,
          min_layers: int = 1, heal=None, heal_steps: int = 0, twin=None, log=print) -> tuple[Drafter, dict]:
    """Remove layers one at a time (see module docstring). Resumes from run_dir/state.json.

    heal: optional function drafter -> None that fine-tunes a freshly pruned drafter in place; the stopping
    rule then judges the healed drafter, and a removal whose healed tau falls below the floor is undone.
    Rerunning with another keep_ratio / min_layers / heal_steps (a label of `heal`) continues from where
    the run stands. twin: optional function drafter -> the copy that trials and timings run on (see the module
    docstring); the drafter itself where None.
    Returns (pruned drafter, state dict)."""
    import json

    state_path, current = run_dir / "state.json", run_dir / "current"
    trial = twin or (lambda d: d)
    runs = None  # trial(drafter), made when first needed and kept while the drafter stays the same
    context = next(p + c for p, c in zip(*next(iter(calib.values()))))[:256]
    if state_path.exists():
        state = json.loads(state_path.read_text())
        if state["layers_before"] != len(drafter.layers):
            raise ValueError(f"{state_path} belongs to a {state['layers_before']}-layer drafter")
        drafter = _resume(drafter, state["stack"], current if state["steps"] else None)
        if state.get("rule") != [keep_ratio, min_layers, heal_steps]:
            state["stopped"] = None  # a new stopping rule: look again from where the run stands
        log(f"resumed from {state_path}: {len(state['steps'])} layers removed")
    else:
        runs = trial(drafter)
        tau0 = calibration_tau(runs, calib, max_new_tokens)
        state = {"layers_before": len(drafter.layers), "tau_before": tau0,
                 "stack": list(range(len(drafter.layers))), "init_layers": list(drafter.cfg.init_layers),
                 "times_before": draft_times(runs, context), "steps": [], "stopped": None}
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(state_path, state)
    state["rule"] = [keep_ratio, min_layers, heal_steps]
    floor = keep_ratio * state["tau_before"]["mean"]
    while state["stopped"] is None:
        n = len(drafter.layers)
        if n <= min_layers:
            state["stopped"] = f"layer budget reached ({n} layers)"
            break
        done = state.setdefault("trials", {})  # this step's layers tried so far, by stack layer: a killed run
        trials = {}                             # resumes within a step (24 trials of the pair's drafter: an hour)
        for i in tqdm(range(n), desc=f"prune step {len(state['steps']) + 1} ({n} layers)", mininterval=2):
            key = str(state["stack"][i])
            if key not in done:
                if runs is None:
                    runs = trial(drafter)
                with bypassed(runs, {i}):
                    done[key] = calibration_tau(runs, calib, max_new_tokens)
                atomic_write_json(state_path, state)
            trials[i] = done[key]
        best = max(trials, key=lambda i: trials[i]["mean"])
        candidates = {str(state["stack"][k]): v["mean"] for k, v in trials.items()}
        pruned, tau, pruned_runs = remove_layers(drafter, {best}), trials[best], None
        if heal is not None:
            heal(pruned)
            pruned_runs = trial(pruned)
            tau = calibration_tau(pruned_runs, calib, max_new_tokens)
        if tau["mean"] < floor:
            healed = f" after healing (unhealed {trials[best]['mean']})" if heal is not None else ""
            state["stopped"] = (f"removing any further layer keeps < {keep_ratio} of tau "
                                f"(best {tau['mean']}{healed} < {floor:.4f})")
            state["last_candidates"] = candidates
            break
        drafter, runs = pruned, pruned_runs if pruned_runs is not None else trial(pruned)
        removed = state["stack"].pop(best)
        del state["trials"]
        step = {"removed": removed, "init_layer": state["init_layers"][removed] if state["init_layers"] else None,
                "layers": len(drafter.layers), "tau": tau, "candidates": candidates,
                **draft_times(runs, context)}
        if heal is not None:
            step["tau_unhealed"] = trials[best]
        state["steps"].append(step)
        save_drafter(drafter, current)
        atomic_write_json(state_path, state)
        log(f"removed stack layer {removed}: {step['layers']} layers, tau {tau['mean']} "
            f"({tau['mean'] / state['tau_before']['mean']:.3f} of {state['tau_before']['mean']})")
    atomic_write_json(state_path, state)
    return drafter, state


def quantized_twin(drafter: Drafter, mode: str, tokenizer) -> Drafter:
    """A copy of `drafter` in `mode` ("int8" / "int4") on its packed CPU layers, as load_drafter quantizes one: what
    prune's trials run on under `d3d prune --quantize` (the original keeps its fp32 weights)."""
    import copy

    from ..runtime.quantize import apply_quantize

    twin = apply_quantize(copy.deepcopy(drafter), mode, tokenizer, batch_invariant=False)
    twin.pack_cpu_layers()
    return twin


def pruning_report(state: dict, settings: dict) -> dict:
    """results/prune/report.json: the settings, before/after summary, removal order and per-step detail."""
    after = state["steps"][-1]["tau"] if state["steps"] else state["tau_before"]
    return {**settings, "layers_before": state["layers_before"],
            "layers_after": state["layers_before"] - len(state["steps"]), "tau_before": state["tau_before"],
            "tau_after": after, "kept": round(after["mean"] / state["tau_before"]["mean"], 4),
            "stopped": state["stopped"], "last_candidates": state.get("last_candidates"),
            "times_before": state["times_before"],
            "removal_order": [{"removed": s["removed"], "init_layer": s["init_layer"], "layers": s["layers"],
                               "tau_mean": s["tau"]["mean"], "packed_ms": s["packed_ms"]} for s in state["steps"]],
            "steps": state["steps"]}


def _resume(drafter: Drafter, stack: list[int], current: Path | None) -> Drafter:
    """The drafter of a resumed run: the original without the layers no longer in `stack`, with the
    weights saved after the last step (they differ from the original's only if healing ran)."""
    from safetensors.torch import load_file

    d = remove_layers(drafter, [i for i in range(len(drafter.layers)) if i not in stack])
    if current is not None:
        saved = {k: v.float() if v.is_floating_point() else v for k, v in load_file(current / WEIGHTS_NAME).items()}
        d.load_state_dict(saved, strict=False)
    return d


def healer(examples, steps: int, lr: float, run_dir: Path):
    """The healing step of `prune`: fine-tune the drafter after a removal on `examples` for `steps`,
    continuing its own objective (heal_config); checkpoints under run_dir/heal-<layers>."""
    from .train import train

    def heal(d: Drafter) -> None:
        d.requires_grad_(True)
        train(d, examples, heal_config(d, steps, lr), run_dir / f"heal-{len(d.layers)}")
        d.eval().requires_grad_(False)
    return heal


def heldout_taus(model, tok, before: Drafter, after: Drafter, benchmarks: list[str], limit: int,
                 max_new_tokens: int, cache: Path) -> dict:
    """Estimated tau of the drafter before and after pruning on benchmark prompts (first turns), from the
    target's greedy continuations: the check that the pruning choice carries over to prompts it never saw."""
    from .estimate import benchmark_continuations

    conts = benchmark_continuations(model, tok, benchmarks, limit, max_new_tokens, cache)
    out = {}
    for name, pairs in conts.items():
        ids, cs = [p for p, _ in pairs], [c for _, c in pairs]
        out[name] = {"before": round(mean_tau(before, ids, cs, max_new_tokens), 4),
                     "after": round(mean_tau(after, ids, cs, max_new_tokens), 4)}
    if out:
        out["mean"] = {k: round(sum(v[k] for v in out.values()) / len(out), 4) for k in ("before", "after")}
        out["kept"] = round(out["mean"]["after"] / out["mean"]["before"], 4)
    return out
