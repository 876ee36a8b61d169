"""Every vector path of the C++ kernels gives bitwise the plain loops' results, and a CPU with a vector
path never runs the plain loops (tests/kernel_outputs.py computes the outputs, one process per path)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from d3d.runtime.kernels import cpu_flags, cpu_model, kernel_path, requested_path

SCRIPT = Path(__file__).with_name("kernel_outputs.py")


def runnable_paths() -> list[str]:
    flags, paths = cpu_flags(), []
    if "avx512f" in flags:
        paths.append("avx512")
    if {"avx2", "fma"} <= flags:
        paths.append("avx2")
    if platform.machine() in ("aarch64", "arm64"):
        paths.append("neon")
    return paths


def outputs(path: str, tmp_path: Path, threads: int = 2) -> dict:
    out = tmp_path / f"{path}-{threads}.pt"
    env = {**os.environ, "D3D_KERNELS": path, "D3D_KERNEL_THREADS": str(threads)}
    subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, check=True, timeout=600)
    return torch.load(out)


@pytest.fixture(scope="module")
def by_path(tmp_path_factory) -> dict[str, dict]:
    """Each path's outputs: the plain loops and every vector path this CPU runs (one build each)."""
    folder = tmp_path_factory.mktemp("kernel_paths")
    return {path: outputs(path, folder) for path in ("scalar", *runnable_paths())}


@pytest.mark.slow
def test_each_build_runs_the_path_it_was_built_for(by_path):
    assert {path: got["path"] for path, got in by_path.items()} == {path: path for path in by_path}


@pytest.mark.slow
@pytest.mark.parametrize("path", runnable_paths())
def test_each_vector_path_equals_the_plain_loops_bit_for_bit(path, by_path):
    got, scalar = by_path[path], by_path["scalar"]
    assert got["tensors"].keys() == scalar["tensors"].keys()
    differ = [k for k, t in scalar["tensors"].items() if not torch.equal(got["tensors"][k], t)]
    assert not differ, f"{path} differs from the plain loops in: {differ}"


@pytest.mark.slow
def test_one_thread_gives_the_bits_of_two(by_path, tmp_path):
    """Work split between threads never changes a sum's order: 1 thread = the 2 of every published run."""
    path = (runnable_paths() or ["scalar"])[0]
    one, two = outputs(path, tmp_path, threads=1)["tensors"], by_path[path]["tensors"]
    assert [k for k, t in two.items() if not torch.equal(one[k], t)] == []


@pytest.mark.slow
@pytest.mark.parametrize("path", ["scalar", *runnable_paths()])
def test_verification_and_tree_rows_equal_decoding_steps_on_each_path(path, by_path):
    t = by_path[path]["tensors"]
    for model in ("D=64 fp32", "D=64 int8", "D=128 fp32", "D=128 int8"):
        steps, tree = t[f"layers {model} steps"], t[f"layers {model} tree"]
        assert torch.equal(t[f"layers {model} verify"], steps), model
        assert torch.equal(tree[[0, 1]], steps[[0, 1]]), model
        assert torch.equal(tree[[0, 2, 3]], t[f"layers {model} branch a c d"]), model


def test_a_cpu_with_a_vector_path_never_runs_the_plain_loops():
    if requested_path() != "auto":
        pytest.skip("D3D_KERNELS forces a path")
    paths = runnable_paths()
    expected = paths[0] if paths else "pytorch"  # no vector path: the fp32 layers stay on PyTorch
    assert kernel_path() == expected, f"this CPU ({cpu_model()}) runs {kernel_path()}, not {expected}"


def test_an_unknown_or_unrunnable_path_is_a_one_line_error(monkeypatch):
    from d3d.errors import D3DError

    monkeypatch.setenv("D3D_KERNELS", "sse9")
    with pytest.raises(D3DError, match="not a kernel path"):
        requested_path()
    missing = next((p for p in ("avx512", "avx2", "neon") if p not in runnable_paths()), None)
    monkeypatch.setenv("D3D_KERNELS", missing)
    with pytest.raises(D3DError, match="cannot run"):
        requested_path()


HARNESS = Path(__file__).with_name("kernel_harness.cpp")
CSRC = Path(__file__).parents[1] / "src" / "d3d" / "runtime" / "csrc"
FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", f"-I{CSRC}"]  # as d3d.runtime.kernels builds them
NATIVE_FLAGS = {"scalar": ["-march=native", "-DD3D_SCALAR"], "avx512": ["-march=native"],
                "avx2": ["-march=native", "-mno-avx512f", "-mno-avxvnni"], "neon": ["-march=native"]}
# aarch64 builds run under qemu: NEON with and without the dot-product extension (int8 sdot or plain loops)
CROSS = {"neon+dotprod": ["-march=armv8.2-a+dotprod"], "neon": ["-march=armv8-a"],
         "scalar": ["-march=armv8-a", "-DD3D_SCALAR"]}


def harness_lines(compiler: str, flags: list[str], out: Path, runner: list[str] = ()) -> list[str]:
    subprocess.run([compiler, *FLAGS, *flags, str(HARNESS), "-o", str(out)], check=True, timeout=300)
    return subprocess.run([*runner, str(out)], check=True, capture_output=True, text=True, timeout=300).stdout.splitlines()


@pytest.fixture(scope="module")
def reference_lines(tmp_path_factory) -> list[str]:
    lines = harness_lines("g++", NATIVE_FLAGS["scalar"], tmp_path_factory.mktemp("harness") / "scalar")
    assert lines[:3] == ["path scalar", "int8 scalar", "int4 scalar"] and len(lines) > 20
    hashes = dict(line.rsplit(" ", 1) for line in lines[3:])
    for K in (576, 100):  # a one-row product shared out in half groups is the whole product
        assert hashes[f"fp32 1x{K} in half groups"] == hashes[f"fp32 1x{K}"]
    for D in (64, 128):  # rows and heads attended together (chunk by chunk of keys) are each attended alone
        assert hashes[f"attention of rows together D={D}"] == hashes[f"attention of rows one by one D={D}"]
    return lines[3:]


@pytest.mark.slow
@pytest.mark.parametrize("path", runnable_paths())
def test_the_kernel_loops_give_the_plain_loops_bits_without_torch(path, reference_lines, tmp_path):
    lines = harness_lines("g++", NATIVE_FLAGS[path], tmp_path / path)
    assert lines[0] == f"path {path}"
    vnni = path == "avx512" and {"avx512_vnni", "avx512bw"} <= cpu_flags()
    int4 = "avx512-vnni" if vnni else "scalar" if path == "scalar" else "avx2" if path in ("avx2", "avx512") else "neon-dotprod"
    assert lines[2] == f"int4 {int4}"
    assert lines[3:] == reference_lines


@pytest.mark.slow
def test_the_avx_vnni_products_give_the_plain_loops_bits(reference_lines, tmp_path):
    """CPUs with AVX-VNNI but no AVX-512 (Intel's from Alder Lake on) run vpdpbusd on 256-bit registers."""
    if "avx_vnni" not in cpu_flags():
        pytest.skip(f"this CPU ({cpu_model()}) has no AVX-VNNI")
    lines = harness_lines("g++", ["-march=native", "-mno-avx512f"], tmp_path / "avx-vnni")
    assert lines[:3] == ["path avx2", "int8 avx-vnni", "int4 avx-vnni"]
    assert lines[3:] == reference_lines


@pytest.mark.slow
def test_the_avx_vnni_products_give_the_plain_loops_bits_in_evex(reference_lines, tmp_path):
    """The AVX-VNNI paths' loops on a CPU without AVX-VNNI but with AVX-512 VNNI on 256-bit registers (AVX512VL):
    their one AVX-VNNI instruction, vpdpbusd on ymm registers, built in its EVEX encoding, the same operation
    (qemu's x86 emulation has no AVX-VNNI). -mno-avx512bw keeps the AVX-512 VNNI paths out of the build."""
    if not {"avx512_vnni", "avx512vl"} <= cpu_flags():
        pytest.skip(f"this CPU ({cpu_model()}) has no AVX-512 VNNI on 256-bit registers")
    evex = tmp_path / "evex.h"
    evex.write_text("#include <immintrin.h>\n#define _mm256_dpbusd_avx_epi32 _mm256_dpbusd_epi32\n")
    # __AVXVNNI__ by hand: with -mavxvnni GCC picks the VEX encoding for either intrinsic
    lines = harness_lines("g++", ["-march=native", "-mno-avx512bw", "-D__AVXVNNI__", "-include", str(evex)],
                          tmp_path / "avx-vnni-evex")
    assert lines[1:3] == ["int8 avx-vnni", "int4 avx-vnni"]
    assert lines[3:] == reference_lines


@pytest.mark.slow
@pytest.mark.parametrize("build", CROSS)
def test_aarch64_builds_give_the_same_bits_under_qemu(build, reference_lines, tmp_path):
    """The NEON path (and aarch64's plain loops) cross-built and run under qemu-user: the same lines as
    this machine's plain loops, since the kernels use only IEEE-exact operations. .ci/run installs the
    cross compiler and qemu (Debian's g++-aarch64-linux-gnu and qemu-user)."""
    from helpers import system_tool

    if platform.machine() in ("aarch64", "arm64"):
        pytest.skip("this machine is aarch64: the native paths above cover it")
    system_tool("aarch64-linux-gnu-g++", package="g++-aarch64-linux-gnu")
    system_tool("qemu-aarch64", package="qemu-user")
    lines = harness_lines("aarch64-linux-gnu-g++", [*CROSS[build], "-static"], tmp_path / "harness",
                          runner=["qemu-aarch64", "-cpu", "max"])
    dot = "neon-dotprod" if "+" in build else "scalar"
    assert lines[:3] == [f"path {build.split('+')[0]}", f"int8 {dot}", f"int4 {dot}"]
    assert lines[3:] == reference_lines
