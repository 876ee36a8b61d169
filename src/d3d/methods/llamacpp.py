"""External reference: llama.cpp (through llama-cpp-python) on the same weights as our fp32 runtime.

What a CPU user would run instead of d3d, so that `d3d bench --methods llama-cpp` always prints it
beside our numbers. The weights are those of the GGUF file the target was converted from, rewritten
once in the cache as GGUF F32 (dequantized exactly as transformers dequantized them for our fp32
checkpoint), Q8_0 (llama.cpp's int8, requantized from those F32 values) or Q4_0 (`llama-cpp-q4`, its
4-bit blocks of 32, the LM head in Q8_0); `llama-cpp-source` runs that
GGUF file as it is (Qwen2.5-Coder-1.5B-Instruct's is Q4_K_M: what llama.cpp users download), and
`llama-cpp-lookup` runs the F32 file with llama-cpp-python's prompt-lookup drafting
(LlamaPromptLookupDecoding: the next LOOKUP_TOKENS tokens after the latest earlier match of the text's
last 1-2 tokens, verified in one batch). llama-cpp-python is an optional extra
(`pip install -e ".[llamacpp]"`); it builds llama.cpp from source (about 8 minutes on 2 cores). Every
generation runs on one llama.cpp context; its rounds are its forwards (llama.cpp's eval calls), so tau
is 1 without drafting.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..atomic import atomic_path
from ..decoding.engine import PREFILL_CHUNK, GenerationResult, StopChecker
from ..errors import D3DError, first_line
from .registry import Method, Runner, Setup, register
from ..decoding.verify import SamplingParams

WEIGHT_TYPES = ("f32", "q8_0", "q4_0")
LOOKUP_TOKENS = 10  # llama-cpp-python's LlamaPromptLookupDecoding default (transformers' prompt lookup: 10 too)


def source_gguf(model_dir: Path) -> Path:
    """The GGUF file a target folder was converted from (the embedded default's, or a `--target X.gguf`)."""
    from ..runtime.checkpoints import _GGUF_FILE, _GGUF_MODULE, _GGUF_PACKAGE, DEFAULT_TARGET, SOURCE_FILE, find_package_file

    record = Path(model_dir) / SOURCE_FILE
    if record.exists():
        return Path(json.loads(record.read_text())["gguf"])
    if Path(model_dir).name == DEFAULT_TARGET:
        return find_package_file(_GGUF_PACKAGE, _GGUF_MODULE, _GGUF_FILE)
    raise D3DError(f"the llama-cpp reference needs a target converted from a GGUF file; {model_dir} is a "
                   f"Hugging Face folder (convert it with llama.cpp's convert_hf_to_gguf.py and pass --target X.gguf)")


def convert_gguf(src: Path, dst: Path, weights: str) -> Path:
    """Rewrite `src` with every tensor as F32 (dequantized) or Q8_0, same metadata; atomic (d3d.atomic: an
    interruption leaves no temp file). A source the gguf library cannot read is a D3DError naming it."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys
    from gguf.quants import dequantize, quantize

    qtype = {"f32": GGMLQuantizationType.F32, "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[weights]
    file_type = {"f32": 0, "q8_0": 7, "q4_0": 2}[weights]  # llama_ftype: ALL_F32, MOSTLY_Q8_0, MOSTLY_Q4_0
    try:
        reader = GGUFReader(src)
        arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise D3DError(f"cannot read {src} as a GGUF file: {first_line(e)}") from None
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dst) as tmp:
        writer = GGUFWriter(tmp, arch)
        for field in reader.fields.values():
            if field.name in (Keys.General.ARCHITECTURE, Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
                continue
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
        writer.add_file_type(file_type)
        has_output = any(t.name == "output.weight" for t in reader.tensors)
        for t in reader.tensors:
            data = dequantize(t.data, t.tensor_type).astype(np.float32)
            kind = qtype
            # llama-quantize keeps the LM head (a tied embedding too) in 6 bits for 4-bit files; the gguf
            # package cannot write Q6_K, so Q8_0
            if qtype == GGMLQuantizationType.Q4_0 and (t.name == "output.weight" or
                                                         (t.name == "token_embd.weight" and not has_output)):
                kind = GGMLQuantizationType.Q8_0
            # norms and other 1-D tensors stay F32, as llama.cpp's own converter keeps them
            if kind == GGMLQuantizationType.F32 or data.ndim < 2 or data.shape[-1] % 32:
                writer.add_tensor(t.name, data)
            else:
                writer.add_tensor(t.name, quantize(data, kind), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return dst


def gguf_whole(path: Path) -> bool:
    """Whether a GGUF file reads whole: its header parses and every tensor's data lies within the file (a
    truncated file, or one overwritten with something else, fails; the header only is read)."""
    from gguf import GGUFReader

    try:
        size = path.stat().st_size
        return all(int(t.data_offset) + int(t.n_bytes) <= size for t in GGUFReader(path).tensors)
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return False


def reference_gguf(model_dir: Path, weights: str = "f32") -> Path:
    """The cached GGUF of the target's weights as `weights` (f32, q8_0 or q4_0), keyed by its source's content
    (d3d.runtime.checkpoints.content_key), made once under the cache lock (a process that waited finds it
    done), and made again if the cached file no longer reads whole (gguf_whole)."""
    from ..runtime.checkpoints import cache_dir, cache_lock, content_key

    if weights not in WEIGHT_TYPES:
        raise D3DError(f"llama.cpp weights must be one of {', '.join(WEIGHT_TYPES)} (got {weights!r})")
    src = source_gguf(model_dir)
    dst = cache_dir() / "gguf" / f"{Path(model_dir).name}.{content_key(src)}.{weights.upper()}.gguf"
    if dst.exists() and gguf_whole(dst):
        return dst
    with cache_lock(f"gguf-{dst.name}"):
        return dst if dst.exists() and gguf_whole(dst) else convert_gguf(src, dst, weights)


class LlamaCppRunner:
    """runner(prompt_ids, params=..., max_new_tokens=..., stop=...) -> GenerationResult on llama.cpp.

    Prefill is the first evaluation of the prompt (it yields the first token); decode time runs from
    there to the last token, as for our methods."""

    def __init__(self, gguf_path: Path, tokenizer, threads: int, context: int = 4096, lookup: int = 0):
        """lookup: tokens drafted by prompt lookup per round (0: none)."""
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            raise D3DError('the llama-cpp method needs llama-cpp-python: pip install -e ".[llamacpp]" '
                           "(builds llama.cpp from source, about 8 minutes)") from None
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        # with a draft model llama-cpp-python 0.3.36 keeps every position's logits but sizes their array for
        # n_batch positions unless logits_all is set (a longer text then fails); its pages are touched only
        # up to the positions a generation reaches
        self.llm = Llama(model_path=str(gguf_path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         draft_model=draft, logits_all=draft is not None, verbose=False)
        self.forwards = 0
        evaluate = self.llm.eval

        def counting_eval(tokens):  # generate() calls self.eval once per forward (the pending token and its drafts)
            self.forwards += 1
            return evaluate(tokens)

        self.llm.eval = counting_eval
        self.tokenizer = tokenizer
        self.gguf_path = Path(gguf_path)

    def __call__(self, prompt_ids: list[int], params: SamplingParams | None = None, max_new_tokens: int = 128,
                 stop: list[str] | None = None, on_round=None, prefill_check=None, **_) -> GenerationResult:
        """prefill_check(): called before each PREFILL_CHUNK-token slice of the prompt; it raises to stop."""
        params = params or SamplingParams()
        stopper = StopChecker(self.tokenizer, {self.tokenizer.eos_token_id}, max_new_tokens, stop)
        sampling = {"temp": 0.0} if params.greedy else {
            "temp": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": 0.0}
        if params.seed is not None:
            self.llm.set_seed(params.seed)
        self.llm.reset()  # no reuse of an earlier prompt's cache
        res = GenerationResult(prompt_ids=list(prompt_ids))
        t0 = time.perf_counter()
        t_first, reason = t0, None
        if prefill_check is not None:
            self._eval_in_slices(prompt_ids[:-1], prefill_check)
        counted = self.forwards + 1  # the prompt's forward gives the first token, which is no round
        for token in self.llm.generate(list(prompt_ids), repeat_penalty=1.0, **sampling):
            if not res.token_ids:
                t_first = time.perf_counter()
            chunk, reason = stopper.clip(res.token_ids, [token])
            if res.token_ids and chunk:  # tokens of one forward make one round
                if self.forwards > counted:
                    res.acceptance_lengths.append(0)
                    counted = self.forwards
                res.acceptance_lengths[-1] += len(chunk)
            res.token_ids += chunk
            if on_round is not None:
                on_round(chunk, 0)
            if reason:
                break
        res.prefill_s, res.decode_s = t_first - t0, time.perf_counter() - t_first
        res.finish_reason = reason or "length"
        res.text = stopper.final_text(res.token_ids)
        return res

    def _eval_in_slices(self, ids: list[int], check) -> None:
        """Evaluate `ids` into the context a slice at a time, check() before each; generate() then finds
        them cached (its prefix match) and evaluates only the rest of the prompt."""
        for a in range(0, len(ids), PREFILL_CHUNK):
            check()
            self.llm.eval(ids[a:a + PREFILL_CHUNK])
        check()


def _llama_cpp(weights: str | None, lookup: int = 0):
    """weights: f32, q8_0 or q4_0 (the cached rewrite), None for the source GGUF file as it is; lookup: as
    LlamaCppRunner's."""
    def build(s: Setup) -> Runner:
        import torch

        path = source_gguf(s.model_dir) if weights is None else reference_gguf(s.model_dir, weights)
        if weights is None and not gguf_whole(path):
            raise D3DError(f"{path} does not read as a whole GGUF file (truncated or overwritten)")
        run = LlamaCppRunner(path, s.tokenizer, threads=torch.get_num_threads(), context=s.model.args.max_seq_len,
                             lookup=lookup)
        from llama_cpp import llama_print_system_info  # importable: the runner was built
        # what llama.cpp was built for (its SIMD paths): recorded beside our own kernel path
        return Runner(run, block_size=s.block_size, llama_cpp_build=llama_print_system_info().decode().strip())
    return build


LLAMA_CPP = register(Method("llama-cpp", _llama_cpp("f32"), logprobs=False, own_prefill=True,
                            help="reference: llama.cpp on GGUF F32 of the same weights"))
LLAMA_CPP_Q8 = register(Method("llama-cpp-q8", _llama_cpp("q8_0"), logprobs=False, own_prefill=True,
                               help="reference: llama.cpp on GGUF Q8_0"))
LLAMA_CPP_Q4 = register(Method("llama-cpp-q4", _llama_cpp("q4_0"), logprobs=False, own_prefill=True,
                               help="reference: llama.cpp on GGUF Q4_0 (the LM head in Q8_0)"))
LLAMA_CPP_SOURCE = register(Method("llama-cpp-source", _llama_cpp(None), logprobs=False, own_prefill=True,
                                   help="reference: llama.cpp on the GGUF file the target was converted from, "
                                        "as it is (e.g. Q4_K_M)"))
LLAMA_CPP_LOOKUP = register(Method("llama-cpp-lookup", _llama_cpp("f32", LOOKUP_TOKENS), logprobs=False, own_prefill=True,
                                   help="reference: llama.cpp on GGUF F32 with prompt-lookup drafting"))
