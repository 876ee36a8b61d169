"""The decoding methods by name (see d3d.methods.registry): each becomes a function prompt_ids -> GenerationResult
on one target. Importing this module imports every other module of d3d.methods, each of which registers
the methods it declares."""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from ..errors import D3DError
from .registry import DEFAULT_DRAFTERS, REGISTRY, Runner, Setup, default_drafter, get  # noqa: F401 (re-exported)

for _module in pkgutil.iter_modules([str(Path(__file__).parent)]):
    if _module.name not in ("catalog", "registry"):
        importlib.import_module(f"{__package__}.{_module.name}")  # every method module registers its methods

BEST_METHOD = "lookup-tree"  # what `d3d demo` and `d3d serve` use by default (README: Results)
BEST_METHODS = {"Qwen2.5-Coder-1.5B-Instruct": "d3d-tree"}  # targets whose measured best differs (README: Results)


def best_method(target: str | Path | None) -> str:
    """The fastest measured method for a target (by its name or folder name): BEST_METHODS, else BEST_METHOD."""
    return BEST_METHODS.get(Path(str(target)).name, BEST_METHOD) if target else BEST_METHOD

# methods that run the target on a runtime of their own, not on d3d's loaded model, which --quantize
# converts: what they run, and what to do instead (check_quantize). llama-cpp-q8 / llama-cpp-q4 are not: they
# always run llama.cpp's own int8 (Q8_0) / 4-bit (Q4_0), the counterparts of --quantize int8 / int4.
OWN_RUNTIME = {"hf": ("transformers' own fp32 model", "run it without --quantize"),
               "hf-lookup": ("transformers' own fp32 model", "run it without --quantize"),
               "llama-cpp": ("llama.cpp's own F32 GGUF", "use llama-cpp-q8 for int8"),
               "llama-cpp-source": ("llama.cpp on the target's source GGUF as it is", "run it without --quantize"),
               "llama-cpp-lookup": ("llama.cpp's own F32 GGUF", "run it without --quantize")}

# baselines' drafters ship beside the D3D one, under the target's name + this suffix
BASELINE_SUFFIX = {m.name: m.drafter_suffix for m in REGISTRY.values() if m.drafter_suffix}


def make_runner(method: str, model, tokenizer, model_dir: Path, drafter: str | Path | None = None,
                block_size: int = 16, draft_device: str | None = None, quantize_drafter: str | None = None,
                **options) -> Runner:
    """A Runner: (prompt_ids, params=..., max_new_tokens=..., stop=...) -> GenerationResult, with the
    settings it runs with in .settings. quantize_drafter: "int8" for an int8 drafter on any target (None:
    as the target). options: method options, e.g. tree_budget for d3d-tree (None = fitted to this device)."""
    m = get(method)
    check_quantize(getattr(model, "quantized", None), [method])
    setup = Setup(model, tokenizer, Path(model_dir), drafter_path(method, model_dir, drafter), block_size,
                  draft_device, {k: v for k, v in options.items() if v is not None}, quantize_drafter)
    return m.runner(setup)


def drafter_path(method: str, model_dir: Path, drafter: str | Path | None = None) -> Path | None:
    """The checkpoint `method` drafts with: `drafter` if given (checked to exist), else the one shipped for
    the target (an error for a method that ships none); None for methods without a drafter."""
    m = get(method)
    if m.drafter_kind is None:
        return None
    m.check_drafter(drafter or None, model_dir)
    if drafter:
        return Path(drafter)
    sibling = m.default_model(model_dir)
    return Path(sibling) if sibling else default_drafter(model_dir, m.drafter_suffix)


def parse_methods(spec: str) -> list[str]:
    methods = [m.strip() for m in spec.split(",") if m.strip()]
    for m in methods:
        get(m)
    if not methods:
        raise D3DError("no method given")
    return methods


def check_quantize_drafter(mode: str | None, methods: list[str]) -> None:
    """A clear error for a drafter quantization that cannot apply: an unknown mode, or no method in
    `methods` that loads a learned drafter."""
    from ..runtime.quantize import QUANTIZE_MODES

    if mode is None:
        return
    if mode not in QUANTIZE_MODES:
        raise D3DError(f"unknown --quantize-drafter mode {mode!r}; choose from {', '.join(QUANTIZE_MODES)}")
    if not any(get(m).drafter_kind for m in methods):
        raise D3DError(f"--quantize-drafter needs a method with a learned drafter (got {', '.join(methods)})")


def check_quantize(mode: str | None, methods: list[str]) -> None:
    """A one-line error for a target quantization that a method in `methods` would ignore: those that run
    the target on their own runtime (OWN_RUNTIME), not on d3d's model that --quantize converts. One pairing
    is the point of a comparison: llama-cpp-source beside --quantize int4 runs the very 4-bit file that int4
    loaded (d3d.runtime.gguf_load)."""
    if mode is None:
        return
    for m in methods:
        if m in OWN_RUNTIME and not (m == "llama-cpp-source" and mode == "int4"):
            runs, instead = OWN_RUNTIME[m]
            raise D3DError(f"{m} runs {runs}; --quantize does not apply: {instead}")
