"""The method registry: every decoding method is one `Method`, declared in its proposer's own module.

A method says how to build a runner (prompt_ids, params=..., max_new_tokens=..., stop=...) ->
GenerationResult for one loaded target, and which learned drafter it needs, if any; the built
`Runner` carries the settings it runs with (block size, method options as resolved), so nothing
reads them back out of the function. make_runner,
the CLI's --method and drafter-option lookup, the bench and the server (through d3d.load) all go
through the registry, so adding a method is one `register(Method(...))` next to its proposer
(d3d.methods.catalog imports the built-in ones). The CLI's parser must not import the methods (nor torch):
it reads BUILTIN, which register() holds the built-in declarations to, plus anything registered so far.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import D3DError
from ..runtime.known_models import DRAFT_MODELS, KNOWN_MODELS

from ..drafters.kinds import KINDS

if TYPE_CHECKING:
    from ..drafters.kinds import DrafterKind

DEFAULT_DRAFTERS = Path(__file__).parent.parent / "assets" / "drafters"

# The built-in methods as the command line sees them before any is imported: name -> the option that
# names its drafter checkpoint (None: no learned drafter); those of the learned drafters come from their
# kinds. register() refuses a built-in declared otherwise, so the parser's lists cannot drift from the methods.
BUILTIN: dict[str, str | None] = {
    "ar": None, "ngram": None, "lookup-tree": None, "suffix": None, "draft-model": "draft-model",
    **{method: kind.option for kind in KINDS.values() for method in kind.methods},
    "hf": None, "hf-lookup": None, "llama-cpp": None, "llama-cpp-q8": None, "llama-cpp-q4": None,
    "llama-cpp-source": None,
    "llama-cpp-lookup": None,
}


_LOADED_DRAFTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> {key: drafter}


@dataclass
class Setup:
    """What a method's runner is built from: the loaded target, the drafter checkpoint chosen for it
    (None for methods without one) and the method options the user gave."""
    model: object
    tokenizer: object
    model_dir: Path
    drafter_path: Path | None = None
    block_size: int = 16
    draft_device: str | None = None
    options: dict = field(default_factory=dict)
    quantize_drafter: str | None = None  # "int8": the drafter in int8 whatever the target's precision

    @property
    def device(self) -> str:
        return str(next(self.model.parameters()).device)

    def drafter(self, kind: DrafterKind, method: str, device: str | None = None):
        """The drafter checkpoint loaded for this target, checked to be of `kind`. Loaded once per target,
        checkpoint, device and precision: methods built side by side (a bench's d3d, d3d-tree, d3d-async)
        share it, since every generation resets the drafter's cache before it drafts."""
        from ..drafters.files import load_drafter

        path = Path(self.drafter_path).resolve()
        written = (path / "drafter.json").stat().st_mtime_ns if (path / "drafter.json").exists() else None
        key = (str(path), written, device or self.device, self.quantize_drafter)
        target = getattr(self.model, "base_model", self.model)  # a batch slot's (d3d.scheduler): its target's
        loaded = _LOADED_DRAFTERS.setdefault(target, {})
        if key not in loaded:
            loaded[key] = load_drafter(self.drafter_path, target, self.tokenizer, device=key[2],
                                       quantize=self.quantize_drafter)
        d = loaded[key]
        if d.cfg.kind != kind.name:
            hint = next((m.name for m in REGISTRY.values() if m.drafter_kind == d.cfg.kind), "?")
            raise D3DError(f"method {method} needs a drafter of kind {kind.name!r}; {self.drafter_path} is "
                           f"{d.cfg.kind!r} (a drafter of kind {d.cfg.kind!r} is for --method {hint})")
        if target is not self.model:  # each generation of a batch drafts on a KV cache of its own
            from ..runtime.batch import with_own_cache

            return with_own_cache(d)
        return d


class Runner:
    """A method built for one target: called like the engines' generate (prompt_ids, params=...,
    max_new_tokens=..., stop=..., on_round=...) -> GenerationResult. `settings` is what it runs with:
    always block_size (the tokens a round may verify, which request checks reserve), and any option the
    build resolved itself, e.g. d3d-tree's fitted tree_budget (recorded by the bench)."""

    def __init__(self, fn: Callable, **settings):
        self.fn, self.settings = fn, settings

    def __call__(self, prompt_ids, **kwargs):
        return self.fn(prompt_ids, **kwargs)


@dataclass(frozen=True)
class Method:
    """A decoding method. `build(setup)` returns a Runner declaring its settings, or a plain function
    when the only setting is the setup's block size (see `runner`)."""
    name: str
    build: Callable[[Setup], Callable]
    help: str = ""
    drafter_kind: str | None = None  # the name of the learned drafter kind it loads (d3d.drafters.kinds), "model" for a
    #                                  whole pretrained model (draft-model); None: none
    drafter_suffix: str = ""         # its shipped checkpoint: assets/drafters/<target name><suffix>
    drafter_option: str = "drafter"  # the CLI option that names another checkpoint for it
    drafter_required: str = ""       # none is shipped: what its option must name (said by check_drafter)
    retrieves: bool = False          # reads the datastore option (`d3d bench --datastores` runs it per datastore)
    logprobs: bool = True            # its runner records the target's logprobs (logprobs=LogprobRecorder)
    branches: bool = False           # its runner reports each round's accepted branch (on_branch=, before on_round)
    batches: bool = False            # its runner runs on a batch slot (d3d.scheduler.SlotModel): d3d serve decodes it
    #                                  in batched forwards beside other requests
    own_prefill: bool = False        # it runs the prompt on a runtime of its own, in slices with prefill_check()
    #                                  called before each (d3d serve's cancel and deadline; else the worker's
    #                                  ChunkedPrefill on d3d's target does it)

    @property
    def option(self) -> str | None:
        """The CLI option naming its drafter checkpoint; None without a learned drafter."""
        return self.drafter_option if self.drafter_kind else None

    def check_drafter(self, drafter: str | Path | None, target: str | Path | None = None) -> None:
        """Before anything loads, a one-line error for a drafter that is missing (a method that ships none:
        drafter_required, unless draft-model knows the `target`'s sibling: DRAFT_MODELS) or names nothing
        (a path that does not exist, unless it is a whole model known by name, which draft-model fetches)."""
        if drafter is None:
            if self.drafter_required and self.default_model(target) is None:
                raise D3DError(f"method {self.name} needs --{self.drafter_option} {self.drafter_required}")
            return
        known = self.drafter_kind == "model" and str(drafter) in KNOWN_MODELS
        if not known and not Path(drafter).expanduser().exists():
            raise D3DError(f"drafter path does not exist: {drafter}")

    def default_model(self, target: str | Path | None) -> str | None:
        """draft-model's model for a known target given none (by the target's name or folder name)."""
        if self.drafter_kind != "model" or target is None:
            return None
        return DRAFT_MODELS.get(Path(str(target)).name)

    def runner(self, setup: Setup) -> Runner:
        built = self.build(setup)
        return built if isinstance(built, Runner) else Runner(built, block_size=setup.block_size)


REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add (or replace) a method; returns it, so a module can write METHOD = register(Method(...))."""
    if method.name in BUILTIN and BUILTIN[method.name] != method.option:
        raise D3DError(f"method {method.name} takes its drafter from --{method.option}, but registry.BUILTIN "
                       f"says {BUILTIN[method.name]}")
    REGISTRY[method.name] = method
    return method


def check_method_options(options: dict, spell: Callable[[str], str] = str) -> dict:
    """Method options (tree_budget, ar_draft_k and draft_k >= 1; datastore an existing file or "none"), checked;
    `spell` names an option in the error (the CLI's --flag, the API's keyword). Returns them."""
    for name in ("tree_budget", "ar_draft_k", "draft_k"):
        value = options.get(name)
        if value is not None and value < 1:
            raise D3DError(f"{spell(name)} must be >= 1 (got {value})")
    datastore = options.get("datastore")
    if datastore not in (None, "none") and not Path(datastore).expanduser().is_file():
        raise D3DError(f"datastore file does not exist: {datastore}")
    return options


def get(name: str) -> Method:
    if name not in REGISTRY:
        raise D3DError(f"unknown method {name!r}; choose from {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def method_names() -> list[str]:
    """Every method name, without importing a method module: the built-ins, then any other registered."""
    return [*BUILTIN, *(name for name in REGISTRY if name not in BUILTIN)]


def drafter_options() -> dict[str, list[str]]:
    """CLI option -> the methods whose drafter checkpoint it names (built-ins and any other registered)."""
    rows = [*BUILTIN.items(), *((m.name, m.option) for m in REGISTRY.values() if m.name not in BUILTIN)]
    options: dict[str, list[str]] = {}
    for name, option in rows:
        if option:
            options.setdefault(option, []).append(name)
    return options


def default_drafter(model_dir: Path, suffix: str = "") -> Path:
    """The drafter shipped for a target (by the target folder's name), or a clear error."""
    path = DEFAULT_DRAFTERS / (Path(model_dir).name + suffix)
    if not (path / "drafter.json").exists():
        raise D3DError(f"no drafter is shipped at {path.name} for target {Path(model_dir).name}; train one with "
                       f"`d3d train` and pass --drafter PATH")
    return path
