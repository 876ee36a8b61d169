"""Argument checks shared by the commands: each raises D3DError with the option's name, before the model
loads where it can (torch is imported only by the checks that need it)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from ..errors import D3DError, first_line
from ..methods.registry import check_method_options, get


def set_threads(n: int | None) -> None:
    if n is not None and n < 1:
        raise D3DError(f"--threads must be >= 1 (got {n})")
    import torch

    torch.set_num_threads(n or min(2, torch.get_num_threads()))


def output_folder(path: str, option: str) -> Path:
    """`path` as a Path, its folder created (the user asked for a file there), or a one-line error."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise D3DError(f"cannot create the folder of {option} {out}: {e.strerror or e}") from None
    return out


def num_threads() -> int:
    import torch

    return torch.get_num_threads()


def check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise D3DError(f"unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise D3DError(f"device {device!r} requested but CUDA is not available")


def check_budget(max_new_tokens: int, block_size: int) -> None:
    if max_new_tokens <= 0:
        raise D3DError(f"--max-new-tokens must be > 0 (got {max_new_tokens})")
    if block_size < 1:
        raise D3DError(f"--block-size must be >= 1 (got {block_size})")


def method_options(args: argparse.Namespace) -> dict:
    """The method options given (--tree-budget for d3d-tree and lookup-tree, --ar-draft-k for ar-draft,
    --draft-k for draft-model, --datastore, --no-learn and --learn-tokens for both trees), checked; each
    method reads its own from its Setup (learning is on unless --no-learn: None leaves the default)."""
    if args.learn_tokens is not None and args.learn_tokens < 2:
        raise D3DError(f"--learn-tokens must be >= 2 (got {args.learn_tokens})")
    options = {"tree_budget": args.tree_budget, "ar_draft_k": args.ar_draft_k, "draft_k": args.draft_k,
               "datastore": args.datastore, "learn": False if args.no_learn else None,
               "learn_tokens": args.learn_tokens}
    return check_method_options(options, lambda name: "--" + name.replace("_", "-"))


@contextmanager
def loading(what: str):
    """Any failure to read a checkpoint, tokenizer or datastore in the block (config and weights that do
    not match, a file that cannot be read) becomes a one-line D3DError "could not load `what`: ..."; the
    commands load what they run inside it."""
    try:
        yield
    except D3DError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        raise D3DError(f"could not load {what}: {first_line(e)}") from None


def open_target(target: str | None, device: str = "cpu", quantize: str | None = None, compile: bool = False):
    """load_target, with any failure to read the checkpoint reported as a user error."""
    from ..runtime.loading import load_target

    with loading(f"target {target}"):
        return load_target(target, device, quantize=quantize, compile=compile)


def check_max_shards(max_shards: int | None) -> None:
    if max_shards is not None and max_shards < 1:
        raise D3DError(f"--max-shards must be >= 1 (got {max_shards})")


def check_drafter(drafter: str | None) -> None:
    if drafter is not None and not Path(drafter).expanduser().exists():
        raise D3DError(f"drafter path does not exist: {drafter}")


def named_paths(specs: list[str] | None, flag: str, special: tuple[str, ...] = (),
                check: Callable[[str], None] | None = None) -> dict[str, str]:
    """NAME=PATH arguments as {name: path}: names unique, every path existing (or one of `special`);
    `check` (default: check_drafter) checks a path."""
    out: dict[str, str] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not (sep and name and path):
            raise D3DError(f"{flag} takes NAME=PATH arguments (got {spec!r})")
        if name in out:
            raise D3DError(f"{flag}: the name {name!r} is given twice")
        if path not in special:
            (check or check_drafter)(path)
        out[name] = path
    return out


def int_list(spec: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise D3DError(f"{flag} takes comma-separated integers (got {spec!r})") from None
    if not out:
        raise D3DError(f"{flag} is empty")
    return out


def dest(option: str) -> str:
    return option.replace("-", "_")


def drafter_for(method: str, args: argparse.Namespace) -> str | None:
    """The --drafter (or --dflash-drafter, --draft-model, ...) value that `method` uses, checked
    (Method.check_drafter: given if the method ships none, existing unless a model known by name)."""
    m = get(method)
    path = getattr(args, dest(m.drafter_option), None)
    m.check_drafter(path, getattr(args, "target", None))
    return path


def sampling(args: argparse.Namespace):
    from ..decoding.verify import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
