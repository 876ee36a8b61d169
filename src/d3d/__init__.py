"""d3d: asynchronous speculative decoding with standalone diffusion drafters.

`from d3d import load; gen = load(); gen.generate("...")` (see d3d.api); `load` is imported lazily,
so `import d3d` alone does not import torch.
"""
__version__ = "0.1.0"
__all__ = ["load", "Generator"]


def __getattr__(name: str):
    if name in ("load", "Generator"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'd3d' has no attribute {name!r}")
