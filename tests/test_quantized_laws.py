"""Sampling stays lossless in int8 and int4: `--quantize int8|int4` (the target and its drafter quantized)
and `--quantize-drafter int8|int4` (the drafter alone; the target stays fp32), for every built-in method each
option applies to, on the law tests' tiny target with sampling_law's per-method harness (method_runner).

int8 changes the target's law, so under --quantize int8 the reference is the exact law of the same int8
target (and plain `ar` sampling of that runtime is checked against it first); under --quantize-drafter
int8 it is the fp32 target's. The target is quantized as d3d.runtime.loading.load_target does (apply_quantize),
learned drafters are saved and loaded through the registry's Setup.drafter (d3d.drafters.files.load_drafter,
which quantizes them as the option says), and draft-model's model through d3d.methods.draftmodel.load_draft_model.
The target is int8_sensitive(tiny_model()): on the plain tiny target the int8 law is within 0.7-1% (total
variation) of the fp32 one, which 1,200 draws cannot see, so a method verifying against the wrong one of the
two would pass. Each case therefore also shows its draws rejecting the other mode's law.
"""
from __future__ import annotations

import pytest
import torch

import d3d.methods.catalog  # noqa: F401  (imports, so registers, every built-in method)
import d3d.methods.draftmodel
from d3d.methods.draftmodel import DraftModel, load_draft_model
from d3d.drafters.files import save_drafter
from d3d.runtime.quantize import Int4Linear, Int8Linear, apply_quantize
from d3d.drafters.kinds import KINDS
from d3d.methods.registry import BUILTIN, Setup, get
from helpers import EOS, StubTokenizer, needs_suffix, tiny_model
from sampling_law import (FIRST, N_ALL, PARAMS_ID, PROMPT_ALL, TEMP, TRUNCATED, chi2_pvalue, draw, exact_law,
                          method_drafter, method_runner)

REFERENCES = {m for m in BUILTIN if get(m).own_prefill}  # their own runtimes: --quantize never reaches them
# --quantize int8 reaches every other built-in method, --quantize-drafter int8 every one that loads a drafter: a
# built-in method added later gets its cases here at once (and fails them until method_runner runs it). Each
# drafter method samples with temperature alone in one mode and with top-k + top-p in the other.
INT8_PARAMS = {m: (TEMP, TRUNCATED)[i % 2] for i, m in enumerate(m for m in BUILTIN if m not in REFERENCES)}
CASES = [(bits, m, p) for bits in ("int8", "int4") for m, p in INT8_PARAMS.items()] + \
        [(f"drafter-{bits}", m, TRUNCATED if INT8_PARAMS[m] is TEMP else TEMP)
         for bits in ("int8", "int4") for m, option in BUILTIN.items() if option]
LINEAR = {"int8": Int8Linear, "int4": Int4Linear}


SHARED_HEAD = 40.0


def int8_sensitive(model):
    """`model` with one large vector (SHARED_HEAD x its output layer's largest |weight|) added to every row of
    its output layer. Softmax is blind to it in fp32 (every logit moves by the same amount: the law stays the
    same), but it sets each row's int8 scale, so in int8 the rounding moves the logits' differences: on the
    tiny target the int8 law is then 0.28 (temperature alone) / 0.47 (top-k + top-p) from the fp32 law in total
    variation, and 1,200 draws of the int8 law rejected the fp32 law with p below 1e-22 in 20 of 20 simulated
    runs (the cases below assert below 1e-6, both ways)."""
    w = model.output.weight.data
    w.add_(SHARED_HEAD * w.abs().max() * torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(3)))
    return model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(mode, method) -> (target, drafter) as the option leaves them: the tiny target in int8 ("int8") or fp32
    ("drafter-int8"), and method_drafter's drafter for `method` saved in fp32, then loaded in int8 the way
    make_runner loads it (None for methods without one). Loaded once per module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny forwards: threading only adds overhead
    tok, folder = StubTokenizer(), tmp_path_factory.mktemp("drafters")
    targets = {"int8": apply_quantize(int8_sensitive(tiny_model()), "int8", tok),
               "int4": apply_quantize(int8_sensitive(tiny_model()), "int4", tok),
               "drafter-int8": int8_sensitive(tiny_model()), "drafter-int4": int8_sensitive(tiny_model())}
    for method, kind in (("d3d", "d3d"), ("ar-draft", "ar"), ("dflash", "dflash")):
        d = method_drafter(method)
        d.cfg.own_embeddings = True  # keep its own (noisy) head: the target's would make it agree too often
        save_drafter(d, folder / kind, dtype=torch.float32)
    memo = {}

    def load(mode: str, method: str):
        if (mode, method) not in memo:
            target, kind = targets[mode], get(method).drafter_kind
            setup = Setup(target, tok, folder, folder / str(kind), options={},
                          quantize_drafter=mode.removeprefix("drafter-") if mode.startswith("drafter-") else None)
            if kind is None:
                drafter = None
            elif kind == "model":  # its whole model: method_drafter's noisy copy, as if loaded from a folder
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(d3d.methods.draftmodel, "resolve_target", lambda name: name)
                    mp.setattr(d3d.methods.draftmodel, "check_same_vocabulary", lambda *a: None)
                    mp.setattr(d3d.methods.draftmodel, "load_runtime", lambda *a: method_drafter("draft-model").model)
                    drafter = DraftModel(load_draft_model(setup))
            else:
                drafter = setup.drafter(KINDS[kind], method)
            memo[mode, method] = target, drafter
        return memo[mode, method]

    yield load
    torch.set_num_threads(threads)


# the quantized target's law vs the fp32 target's
OTHER_MODE = {"int8": "drafter-int8", "drafter-int8": "int8", "int4": "drafter-int4", "drafter-int4": "int4"}


@pytest.fixture(scope="module")
def laws(loaded):
    """(mode, params) -> the exact law of the first FIRST tokens of plain sampling of the target in that mode."""
    memo = {}

    def law(mode, params):
        key = mode, PARAMS_ID[id(params)]
        if key not in memo:
            memo[key] = exact_law(loaded(mode, "ar")[0], PROMPT_ALL, params, FIRST, EOS)
        return memo[key]

    return law


@pytest.mark.slow
@pytest.mark.parametrize("mode,method,params", CASES, ids=[f"{mode}-{m}-{PARAMS_ID[id(p)]}" for mode, m, p in CASES])
def test_sampling_quantized_keeps_the_law(loaded, laws, mode, method, params):
    if method == "suffix":
        needs_suffix()
    target, drafter = loaded(mode, method)
    bits = mode.removeprefix("drafter-")
    assert getattr(target, "quantized", None) == (None if mode.startswith("drafter-") else bits)
    if drafter is not None:  # the drafter really runs quantized, in either mode
        model = drafter.model if isinstance(drafter, DraftModel) else drafter
        assert isinstance(model.layers[0].feed_forward.w13, LINEAR[bits])
    samples, rounds = draw(method_runner(method, target, drafter), params, N_ALL, FIRST)
    dist = laws(mode, params)
    assert set(samples) <= set(dist)
    if method != "ar":
        assert sum(n for length, n in rounds.items() if length > 1) > 100  # drafts really were accepted
    assert chi2_pvalue(samples, dist) > 1e-3
    assert chi2_pvalue(samples, laws(OTHER_MODE[mode], params)) < 1e-6  # the draws can tell it from fp32
