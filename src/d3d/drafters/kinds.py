"""Drafter kinds: everything that differs between the learned drafters, in one place.

A kind is what a checkpoint's drafter.json says it is (`kind`) and what `d3d train --kind` builds.
Training, loading, pruning and the CLI ask the kind object; no other module tests a kind's name.

Adding a drafter kind: its model (a Drafter subclass in d3d.drafters), its method (a module of
d3d.methods with a proposer, a runner and `register(Method(..., drafter_kind=KIND.name))`), one
DrafterKind in KINDS below (which also tells the CLI's parser its methods and option), and tests. This module imports neither torch nor a model (the CLI's
parser reads it); `model_class` imports the model on first use.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import D3DError


@dataclass(frozen=True)
class DrafterKind:
    name: str                   # drafter.json's `kind`, `d3d train --kind`
    model: str                  # "module:Class" of its Drafter subclass
    methods: tuple[str, ...]    # the built-in methods that draft with it
    option: str                 # the CLI option that names a checkpoint of it (--drafter, ...)
    ar_weight: float            # default weight of the auxiliary next-token loss (--ar-weight)
    blocks: bool = True         # trains on masked blocks; False: the next-token loss only (--ar-weight > 0)
    reads_target: bool = False  # drafts from the target's hidden states after cfg.target_layers (slot 0 is
    #                             given, the target stays loaded while training)
    target_taps: int = 0        # how many target layers it reads by default (spread_layers)
    converts: bool = False      # may be converted from a whole other model (--init-model)
    layers: tuple[int, ...] = (26, 27, 28, 29)  # default target layers that initialise its stack (--layers)
    draft_vocab: int = 8192     # default draft vocabulary (--draft-vocab; 0 = the target's)
    help: str = ""

    def model_class(self):
        module, name = self.model.split(":")
        return getattr(importlib.import_module(module), name)


D3D = DrafterKind("d3d", "d3d.drafters.drafter:Drafter", ("d3d", "d3d-async", "d3d-tree"), "drafter", ar_weight=0.5,
                  converts=True, help="standalone block diffusion")
AR = DrafterKind("ar", "d3d.drafters.drafter:Drafter", ("ar-draft",), "ar-drafter", ar_weight=1.0, blocks=False,
                 help="a causal drafter, one token per pass (baseline)")
DFLASH = DrafterKind("dflash", "d3d.drafters.dflash:DFlashDrafter", ("dflash",), "dflash-drafter", ar_weight=0.0,
                     reads_target=True, target_taps=4,
                     help="block diffusion conditioned on the target's hidden states (baseline)")
KINDS: dict[str, DrafterKind] = {k.name: k for k in (D3D, AR, DFLASH)}


def get_kind(name: str) -> DrafterKind:
    if name not in KINDS:
        raise D3DError(f"unknown drafter kind {name!r}; choose from {', '.join(KINDS)}")
    return KINDS[name]


def spread_layers(n_target_layers: int, n: int = 5) -> list[int]:
    """n layers spread evenly from the second to the third-to-last (the span DFlash draws its taps from)."""
    lo, hi = 1, n_target_layers - 3
    return sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)})
