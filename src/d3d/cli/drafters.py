"""The commands that make drafters, data (self-distillation), datastore, train and prune: their arguments and what they run."""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from ..drafters.kinds import D3D, KINDS
from ..errors import D3DError
from .checks import check_drafter, check_max_shards, int_list, loading, open_target


def check_datasets(data: str, extra: list[str] | None) -> list[str]:
    """The extra dataset folders, after checking that `data` and each of them hold a dataset."""
    for folder in [data] + (extra or []):
        if not (Path(folder) / "manifest.json").exists():
            raise D3DError(f"no dataset at {folder} (build one with `d3d data --out {folder}`)")
    return extra or []


def cmd_data(args: argparse.Namespace) -> None:
    from ..runtime.checkpoints import DEFAULT_TARGET
    from ..corpus.data import build_dataset, dataset_manifest

    for name in ("max_tokens", "max_new_tokens", "batch_size", "shard_size"):
        if getattr(args, name) <= 0:
            raise D3DError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(args, name)})")
    dataset_manifest(Path(args.out), args.target or DEFAULT_TARGET, args.max_new_tokens, shard_size=args.shard_size,
                     prompts=args.prompts, quantize=args.quantize)  # other settings fail before the target loads
    model, tok, model_dir = open_target(args.target, quantize=args.quantize)
    log_path = Path(args.out) / "progress.log"
    Path(args.out).mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        with open(log_path, "a") as f:
            f.write(msg + "\n")

    m = build_dataset(model, tok, Path(args.out), args.target or DEFAULT_TARGET, args.max_tokens,
                      args.max_new_tokens, batch_size=args.batch_size, shard_size=args.shard_size,
                      prompts=args.prompts, log=log, quantize=args.quantize)
    print(f"{args.out}: {m['examples']} examples, {m['response_tokens']} response tokens")


def cmd_datastore(args: argparse.Namespace) -> None:
    from ..runtime.checkpoints import read_hf_config, resolve_target
    from ..corpus.datastore import build_datastore, save_datastore

    extra = check_datasets(args.data, args.extra_data)
    check_max_shards(args.max_shards)
    vocab_size = read_hf_config(resolve_target(args.target))["vocab_size"]
    tokens, meta = build_datastore(args.data, vocab_size, args.max_shards, extra)
    meta["command"] = "d3d " + shlex.join(args.argv)
    save_datastore(args.out, tokens, vocab_size, meta)
    print(f"{args.out}: {meta['examples']} examples, {meta['tokens']} tokens "
          f"({Path(args.out).stat().st_size / 1e6:.1f} MB)")


def cmd_train(args: argparse.Namespace) -> None:
    from ..training.train import TrainConfig, train_drafter

    extra = check_datasets(args.data, args.extra_data)
    check_max_shards(args.max_shards)
    from ..runtime.checkpoints import read_hf_config, resolve_target
    from ..drafters.kinds import get_kind, spread_layers

    lora_init = False
    if args.init:
        check_drafter(args.init)
        from ..drafters.files import read_drafter_config

        lora_init = read_drafter_config(Path(args.init)).lora_rank > 0  # its adapters train on (continued_lora_drafter)
    kind = get_kind(args.kind)
    if args.init_model is not None and (args.init or not kind.converts):
        raise D3DError(f"--init-model builds a new drafter of a kind that converts a whole model; it excludes "
                       f"--init and --kind {kind.name}")
    if args.lora_rank < 0 or (args.lora_rank and args.init_model in (None, "target") and not lora_init):
        raise D3DError("--lora-rank needs --init-model NAME|PATH (a model other than the target) or --init of a LoRA "
                       "drafter, and must be >= 0")
    if args.heldout < 1:
        raise D3DError(f"--heldout must be >= 1 (got {args.heldout})")
    if args.freeze_below is None:  # a LoRA drafter goes on with the layers it adapts
        from ..training.train import adapted_layers, stored_weights

        args.freeze_below = adapted_layers(stored_weights(Path(args.init)))[0] if lora_init else 0
    if args.freeze_below < 0:
        raise D3DError(f"--freeze-below must be >= 0 (got {args.freeze_below})")
    if args.max_file_mb is not None and args.max_file_mb <= 0:
        raise D3DError(f"--max-file-mb must be > 0 (got {args.max_file_mb})")
    whole = args.init_model is not None
    layers = None if whole and args.layers is None else \
        int_list(args.layers, "--layers") if args.layers else list(kind.layers)
    draft_vocab = args.draft_vocab if args.draft_vocab is not None else 0 if whole else kind.draft_vocab
    ar_weight = kind.ar_weight if args.ar_weight is None else args.ar_weight
    if not 0 <= args.layer_drop < 1:
        raise D3DError(f"--layer-drop must be in [0, 1) (got {args.layer_drop})")
    if not 0 <= args.distill <= 1:
        raise D3DError(f"--distill must be in [0, 1] (got {args.distill})")
    if not kind.blocks and ar_weight <= 0:
        raise D3DError(f"--kind {kind.name} trains with the next-token loss only: --ar-weight must be > 0")
    n = read_hf_config(resolve_target(args.target))["num_hidden_layers"]
    if not whole and not args.init and not all(0 <= i < n for i in layers):  # --init: its own layers win
        raise D3DError(f"--layers must lie in 0..{n - 1} (got {layers})")
    target_layers = None
    if kind.reads_target:
        target_layers = int_list(args.target_layers, "--target-layers") if args.target_layers \
            else spread_layers(n, kind.target_taps)
        if not all(0 <= i < n for i in target_layers):
            raise D3DError(f"--target-layers must lie in 0..{n - 1} (got {target_layers})")
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, ar_weight=ar_weight,
                      gamma=args.gamma, blocks_per_seq=args.blocks_per_seq if kind.blocks else 0, seed=args.seed,
                      warmup=args.warmup, max_prompt_tokens=args.max_prompt_tokens, layer_drop=args.layer_drop,
                      freeze_below=args.freeze_below, distill=args.distill, bf16=args.bf16)
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
    from ..corpus.data import load_dataset
    from ..atomic import atomic_write_json
    from ..drafters.files import load_drafter, save_drafter
    from ..methods.catalog import default_drafter
    from ..bench.plots import plot_pruning
    from ..corpus.prompts import CALIBRATION_SETS
    from ..training.prune import calibration_data, healer, heldout_taus, prune, pruning_report, quantized_twin

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
    model, tok, model_dir = open_target(args.target, "cpu", quantize=args.quantize)
    src = args.drafter or default_drafter(model_dir)
    with loading(f"drafter {src}"):
        drafter = load_drafter(src, model, tok, quantize="fp32" if args.quantize else None)
    if not 1 <= args.min_layers <= len(drafter.layers):
        raise D3DError(f"--min-layers must be in 1..{len(drafter.layers)} (got {args.min_layers})")
    run_dir = Path(args.run_dir or Path(args.out).with_name(Path(args.out).name + ".run"))
    run_dir.mkdir(parents=True, exist_ok=True)
    calib = calibration_data(model, tok, sets, args.prompts_per_set, args.max_new_tokens, run_dir / "calibration.json")
    heal = healer(load_dataset(args.data, args.max_shards), args.heal_steps, args.heal_lr, run_dir) \
        if args.heal_steps else None
    twin = (lambda d: quantized_twin(d, args.quantize, tok)) if args.quantize else None
    pruned, state = prune(drafter, calib, args.max_new_tokens, run_dir, keep_ratio=args.keep_ratio,
                          min_layers=args.min_layers, heal=heal, heal_steps=args.heal_steps, twin=twin)
    report = pruning_report(state, {
        "command": "d3d " + shlex.join(args.argv), "drafter": str(src), "out": args.out, "calibration_sets": sets,
        "prompts_per_set": args.prompts_per_set, "max_new_tokens": args.max_new_tokens,
        "keep_ratio": args.keep_ratio, "min_layers": args.min_layers, "heal_steps": args.heal_steps,
        "quantize": args.quantize})
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


def _data(sub) -> None:
    p = sub.add_parser("data", help="generate self-distillation data from the target (resumable)")
    p.add_argument("--target", default=None)
    p.add_argument("--out", default="data/distill")
    p.add_argument("--prompts", default="mix", choices=("mix", "code", "chat"),
                   help="mix: GSM8K/MATH train and ShareGPT; code: code requests and stdlib function stubs; "
                        "chat: other ShareGPT requests that neither uses")
    p.add_argument("--max-tokens", type=int, default=1_000_000, help="stop once this many response tokens exist")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--shard-size", type=int, default=128)
    p.add_argument("--quantize", choices=("int8", "int4"), default=None,
                   help="the target's weights (default fp32); recorded in the folder's settings")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_data)


def _datastore(sub) -> None:
    p = sub.add_parser("datastore", help="index distillation data for retrieval by d3d-tree and lookup-tree")
    p.add_argument("--data", default="data/distill")
    p.add_argument("--out", required=True, help="datastore file to write (.npz)")
    p.add_argument("--max-shards", type=int, default=None, help="the first N data shards only")
    p.add_argument("--extra-data", action="append", metavar="DIR",
                   help="another dataset (e.g. `d3d data --prompts code`) indexed whole after --data; repeatable")
    p.add_argument("--target", default=None, help="the target the data came from (checks its vocabulary)")
    p.set_defaults(func=cmd_datastore)


def _train(sub) -> None:
    p = sub.add_parser("train", help="train a D3D drafter on distillation data (resumable; accelerate-ready)")
    p.add_argument("--target", default=None)
    p.add_argument("--data", default="data/distill")
    p.add_argument("--out", required=True, help="drafter folder to write (drafter.safetensors + drafter.json)")
    p.add_argument("--run-dir", default=None, help="checkpoints and history (default: OUT.run); reused to resume")
    p.add_argument("--layers", default=None,
                   help="target layers that initialise the drafter stack (default 26,27,28,29; "
                        "with --init-model: layers of that model, default all)")
    p.add_argument("--init", default=None, help="fine-tune this drafter checkpoint instead of building a new one (a LoRA "
                   "drafter: its adapters train on, from its files; --lora-rank may raise their rank)")
    p.add_argument("--init-model", nargs="?", const="target", default=None, metavar="PATH_OR_NAME",
                   help="convert a whole pretrained causal LM with the target's tokenizer (a HF folder, a .gguf, "
                        "or `target`, the default when the flag has no value) into a token-shift block-diffusion "
                        "drafter; made from the target, layers kept frozen are stored as references (delta)")
    p.add_argument("--freeze-below", type=int, default=None,
                   help="keep drafter stack layers 0..N-1 frozen (default 0; with --init of a LoRA drafter, the layers "
                        "below its adapters)")
    p.add_argument("--heldout", type=int, default=64, metavar="N",
                   help="the last N examples of --data are held out: evaluated before and after, never trained on")
    p.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="with --init-model NAME|PATH: train rank-R adapters (and the mask embedding) instead of "
                        "whole layers; the drafter stores only those, over that model's weights (default 0: off); "
                        "with --init of a LoRA drafter: its adapters' new rank, at least theirs")
    p.add_argument("--max-file-mb", type=float, default=None, help="split the weights into files of at most this size")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="LM head rows (most frequent tokens); 0 = all (default 8192; with --init-model 0)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--max-prompt-tokens", type=int, default=64, help="prompt tail kept as training context")
    p.add_argument("--kind", choices=tuple(KINDS), default=D3D.name,
                   help="; ".join(f"{k.name}: {k.help}, for --method {', '.join(k.methods)}" for k in KINDS.values()))
    p.add_argument("--target-layers", default=None, help="dflash: target layers to read (default: 4 spread out)")
    p.add_argument("--ar-weight", type=float, default=None,
                   help="lambda of the auxiliary AR loss (default: " + ", ".join(f"{k.name} {k.ar_weight:g}" for k in KINDS.values()) + ")")
    p.add_argument("--gamma", type=float, default=7.0, help="slot k loss weight exp(-k / gamma)")
    p.add_argument("--blocks-per-seq", type=int, default=12)
    p.add_argument("--distill", type=float, default=0.0, metavar="W",
                   help="also learn the target's soft labels (its next-token law, computed per batch), "
                        "weighted W against its greedy tokens' 1 - W (0..1; costs a target forward per step)")
    p.add_argument("--layer-drop", type=float, default=0.0,
                   help="LayerDrop: skip each drafter layer with this probability per step (makes it prunable)")
    p.add_argument("--bf16", action="store_true",
                   help="mixed precision: the matrix products in bfloat16 under torch.autocast, weights, AdamW state "
                        "and losses in fp32 (about twice the tokens/s on CPUs with AVX512-BF16 or AMX, and on GPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shards", type=int, default=None, help="train on the first N data shards only")
    p.add_argument("--extra-data", action="append", metavar="DIR",
                   help="another dataset whose every example joins training (held-out stays --data's); repeatable")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_train)


def _prune(sub) -> None:
    p = sub.add_parser("prune", help="remove drafter layers one at a time by their effect on tau (resumable)")
    p.add_argument("--drafter", default=None, help="drafter to prune (default: the one shipped for the target)")
    p.add_argument("--out", required=True, help="folder for the pruned drafter")
    p.add_argument("--run-dir", default=None, help="calibration cache and resumable state (default: OUT.run)")
    p.add_argument("--report", default="results/prune/report.json", help="report JSON (plot beside it)")
    p.add_argument("--sets", default="math,code,chat", help="calibration sets (never benchmark test prompts)")
    p.add_argument("--prompts-per-set", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--keep-ratio", type=float, default=0.99, help="stop before mean tau drops below this share")
    p.add_argument("--min-layers", type=int, default=1, help="layer budget: never go below this many layers")
    p.add_argument("--heal-steps", type=int, default=0, help="fine-tune steps after each removal (0 = none)")
    p.add_argument("--heal-lr", type=float, default=2e-4)
    p.add_argument("--data", default="data/distill", help="training data for healing")
    p.add_argument("--max-shards", type=int, default=None, help="heal on the first N data shards only")
    p.add_argument("--heldout", default="gsm8k,math500,humaneval,mt-bench,sharegpt",
                    help="benchmarks on which to check tau before/after ('' = skip)")
    p.add_argument("--heldout-limit", type=int, default=5)
    p.add_argument("--target", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="target, trials and timings in int8 / int4 (removals and the saved drafter stay fp32)")
    p.set_defaults(func=cmd_prune)


PARSERS = (_data, _datastore, _train, _prune)
