"""The commands that make drafters: data (self-distillation), train and prune."""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from ..errors import D3DError
from .checks import check_drafter, check_max_shards, int_list, loading, open_target


def check_datasets(data: str, extra: list[str] | None) -> list[str]:
    """The extra dataset folders, after checking that `data` and each of them hold a dataset."""
    for folder in [data] + (extra or []):
        if not (Path(folder) / "manifest.json").exists():
            raise D3DError(f"no dataset at {folder} (build one with `d3d data --out {folder}`)")
    return extra or []


def cmd_data(args: argparse.Namespace) -> None:
    from ..checkpoints import DEFAULT_TARGET
    from ..data import build_dataset, dataset_manifest

    for name in ("max_tokens", "max_new_tokens", "batch_size", "shard_size"):
        if getattr(args, name) <= 0:
            raise D3DError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(args, name)})")
    dataset_manifest(Path(args.out), args.target or DEFAULT_TARGET, args.max_new_tokens, shard_size=args.shard_size,
                     prompts=args.prompts)  # a folder made with other settings fails before the target loads
    model, tok, model_dir = open_target(args.target)
    getattr(model, "drop_cpu_layers", lambda: None)()  # batched generation runs on the PyTorch layers
    log_path = Path(args.out) / "progress.log"
    Path(args.out).mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        with open(log_path, "a") as f:
            f.write(msg + "\n")

    m = build_dataset(model, tok, Path(args.out), args.target or DEFAULT_TARGET, args.max_tokens,
                      args.max_new_tokens, batch_size=args.batch_size, shard_size=args.shard_size,
                      prompts=args.prompts, log=log)
    print(f"{args.out}: {m['examples']} examples, {m['response_tokens']} response tokens")


def cmd_datastore(args: argparse.Namespace) -> None:
    from ..checkpoints import read_hf_config, resolve_target
    from ..datastore import build_datastore, save_datastore

    extra = check_datasets(args.data, args.extra_data)
    check_max_shards(args.max_shards)
    vocab_size = read_hf_config(resolve_target(args.target))["vocab_size"]
    tokens, meta = build_datastore(args.data, vocab_size, args.max_shards, extra)
    meta["command"] = "d3d " + shlex.join(args.argv)
    save_datastore(args.out, tokens, vocab_size, meta)
    print(f"{args.out}: {meta['examples']} examples, {meta['tokens']} tokens "
          f"({Path(args.out).stat().st_size / 1e6:.1f} MB)")


def cmd_train(args: argparse.Namespace) -> None:
    from ..train import TrainConfig, train_drafter

    extra = check_datasets(args.data, args.extra_data)
    check_max_shards(args.max_shards)
    from ..checkpoints import read_hf_config, resolve_target
    from ..dflash import default_target_layers

    if args.init:
        check_drafter(args.init)
        from ..drafter_files import read_drafter_config

        if read_drafter_config(Path(args.init)).lora_rank:  # loading merges the adapters: nothing would train
            raise D3DError(f"--init {args.init} is a LoRA drafter; continue its training from its run folder "
                           "instead (the command that made it, with a larger --steps and the same --run-dir)")
    if args.init_model is not None and (args.init or args.kind != "d3d"):
        raise D3DError("--init-model builds a new d3d drafter: it excludes --init and --kind other than d3d")
    if args.lora_rank < 0 or (args.lora_rank and args.init_model in (None, "target")):
        raise D3DError("--lora-rank needs --init-model NAME|PATH (a model other than the target) and must be >= 0")
    if args.heldout < 1:
        raise D3DError(f"--heldout must be >= 1 (got {args.heldout})")
    if args.freeze_below < 0:
        raise D3DError(f"--freeze-below must be >= 0 (got {args.freeze_below})")
    if args.max_file_mb is not None and args.max_file_mb <= 0:
        raise D3DError(f"--max-file-mb must be > 0 (got {args.max_file_mb})")
    whole = args.init_model is not None
    layers = None if whole and args.layers is None else int_list(args.layers or "26,27,28,29", "--layers")
    draft_vocab = args.draft_vocab if args.draft_vocab is not None else 0 if whole else 8192
    ar_weight = {"d3d": 0.5, "dflash": 0.0, "ar": 1.0}[args.kind] if args.ar_weight is None else args.ar_weight
    if not 0 <= args.layer_drop < 1:
        raise D3DError(f"--layer-drop must be in [0, 1) (got {args.layer_drop})")
    if not 0 <= args.distill <= 1:
        raise D3DError(f"--distill must be in [0, 1] (got {args.distill})")
    if args.kind == "ar" and ar_weight <= 0:
        raise D3DError("--kind ar trains with the next-token loss only: --ar-weight must be > 0")
    n = read_hf_config(resolve_target(args.target))["num_hidden_layers"]
    if not whole and not all(0 <= i < n for i in layers):
        raise D3DError(f"--layers must lie in 0..{n - 1} (got {layers})")
    target_layers = None
    if args.kind == "dflash":
        target_layers = int_list(args.target_layers, "--target-layers") if args.target_layers \
            else default_target_layers(n, 4)
        if not all(0 <= i < n for i in target_layers):
            raise D3DError(f"--target-layers must lie in 0..{n - 1} (got {target_layers})")
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, ar_weight=ar_weight,
                      gamma=args.gamma, blocks_per_seq=0 if args.kind == "ar" else args.blocks_per_seq, seed=args.seed,
                      warmup=args.warmup, max_prompt_tokens=args.max_prompt_tokens, layer_drop=args.layer_drop,
                      freeze_below=args.freeze_below, distill=args.distill)
    run_dir = Path(args.run_dir or Path(args.out).with_name(Path(args.out).name + ".run"))
    summary = train_drafter(args.target, Path(args.data), Path(args.out), run_dir, layers, draft_vocab,
                            args.block_size, cfg, command="d3d " + shlex.join(args.argv),
                            max_shards=args.max_shards, kind=args.kind, target_layers=target_layers,
                            init=Path(args.init) if args.init else None, init_model=args.init_model,
                            max_file_mb=args.max_file_mb, extra_data=[Path(x) for x in extra],
                            lora_rank=args.lora_rank, heldout=args.heldout)
    before, after = summary["heldout_before"], summary["heldout_after"]
    tau = f"held-out teacher-forced tau {before['tau']} -> {after['tau']}, " if "tau" in after else ""
    print(f"{args.out}: {tau}held-out loss {before['loss']} -> {after['loss']}")


def cmd_prune(args: argparse.Namespace) -> None:
    from ..data import atomic_write_json, load_dataset
    from ..drafter_files import load_drafter, save_drafter
    from ..methods import default_drafter
    from ..plots import plot_pruning
    from ..prompts import CALIBRATION_SETS
    from ..prune import calibration_data, healer, heldout_taus, prune, pruning_report

    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    bad = [s for s in sets if s not in CALIBRATION_SETS]
    if bad or not sets:
        raise D3DError(f"--sets must name some of {', '.join(CALIBRATION_SETS)} (got {args.sets!r})")
    if not 0 < args.keep_ratio <= 1:
        raise D3DError(f"--keep-ratio must be in (0, 1] (got {args.keep_ratio})")
    if args.heal_steps and not (Path(args.data) / "manifest.json").exists():
        raise D3DError(f"--heal-steps needs training data; none at {args.data}")
    check_max_shards(args.max_shards)
    check_drafter(args.drafter)
    model, tok, model_dir = open_target(args.target, "cpu")
    src = args.drafter or default_drafter(model_dir)
    with loading(f"drafter {src}"):
        drafter = load_drafter(src, model, tok)
    if not 1 <= args.min_layers <= len(drafter.layers):
        raise D3DError(f"--min-layers must be in 1..{len(drafter.layers)} (got {args.min_layers})")
    run_dir = Path(args.run_dir or Path(args.out).with_name(Path(args.out).name + ".run"))
    run_dir.mkdir(parents=True, exist_ok=True)
    calib = calibration_data(model, tok, sets, args.prompts_per_set, args.max_new_tokens, run_dir / "calibration.json")
    heal = healer(load_dataset(args.data, args.max_shards), args.heal_steps, args.heal_lr, run_dir) \
        if args.heal_steps else None
    pruned, state = prune(drafter, calib, args.max_new_tokens, run_dir, keep_ratio=args.keep_ratio,
                          min_layers=args.min_layers, heal=heal, heal_steps=args.heal_steps)
    report = pruning_report(state, {
        "command": "d3d " + shlex.join(args.argv), "drafter": str(src), "out": args.out, "calibration_sets": sets,
        "prompts_per_set": args.prompts_per_set, "max_new_tokens": args.max_new_tokens,
        "keep_ratio": args.keep_ratio, "min_layers": args.min_layers, "heal_steps": args.heal_steps})
    if args.heldout:
        names = [b.strip() for b in args.heldout.split(",") if b.strip()]
        report["heldout"] = heldout_taus(model, tok, drafter, pruned, names, args.heldout_limit, args.max_new_tokens,
                                         run_dir / "heldout.json")
    pruned.cfg.training = dict(pruned.cfg.training, pruning={
        k: report[k] for k in ("command", "drafter", "layers_before", "layers_after", "tau_before", "tau_after")})
    save_drafter(pruned, Path(args.out))
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(args.report), report)
    plot_pruning(report, Path(args.report).with_suffix(".png"))
    print(f"{args.out}: {report['layers_before']} -> {report['layers_after']} layers, mean calibration tau "
          f"{report['tau_before']['mean']} -> {report['tau_after']['mean']} ({report['kept']:.1%} kept); "
          f"{state['stopped']}; wrote {args.report}")
