"""Retrieval from the target's own outputs (d3d.corpus.datastore): lookups agree with a brute-force scan, prefer
the longest context match, stop at an example's end, and files round-trip and fail clearly."""
from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest

from d3d.cli import main
from d3d.corpus.data import save_shard
from d3d.corpus.datastore import (MAX_MATCH_LEN, MAX_MATCHES, Datastore, build_datastore, load_datastore,
                           save_datastore)
from d3d.errors import D3DError

VOCAB = 49152  # SmolLM2's: 16-bit tokens, keys of 4 tokens


def store(examples: list[list[int]], vocab: int = VOCAB) -> Datastore:
    sep = (1 << vocab.bit_length()) - 1
    return Datastore(np.array([t for e in examples for t in e + [sep]]), vocab)


def brute_force(examples: list[list[int]], text: list[int]) -> tuple[int, Counter]:
    """(longest match, Counter of what followed every position matching that long, None for an example's
    end): a direct scan."""
    best, follows = 0, Counter()
    for e in examples:
        for i in range(len(e)):  # position i = the last matched token
            n = 0
            while n < min(len(text), i + 1, MAX_MATCH_LEN) and e[i - n] == text[-1 - n]:
                n += 1
            if n > best:
                best, follows = n, Counter()
            if n == best and n > 0:
                follows[e[i + 1] if i + 1 < len(e) else None] += 1
    return best, follows


def test_the_longest_match_decides_and_continuations_follow_the_majority():
    s = store([[1, 2, 3, 4, 5, 10, 11], [9, 2, 3, 4, 5, 20, 21], [8, 3, 4, 5, 20, 22]])
    (only,) = s.lookup([1, 2, 3, 4, 5], k=4)  # 5 tokens match only in the first example
    assert only.tokens == [10, 11] and only.match_len == 5 and only.shares == [1.0, 1.0]  # stops at its end
    first, second = s.lookup([7, 3, 4, 5], k=3)  # 3 tokens match all three
    assert first.tokens == [20, 21] and first.match_len == 3 and first.shares == pytest.approx([2 / 3, 1 / 2])
    assert second.tokens == [10, 11] and second.shares == pytest.approx([1 / 3, 1.0])
    assert s.lookup([7, 3, 4, 5], k=3, branches=1) == [first]
    assert s.lookup([6, 6], k=3) == [] and s.lookup([], k=3) == [] and s.lookup([5], k=0) == []
    assert s.lookup([1, 2, 3, 4, 5, 10, 11], k=3) == []  # the end of an example has no continuation
    assert s.lookup([1, 2, 3, 4, 5], k=100) == [only]  # k beyond the padding is cut, not an index error


@pytest.mark.parametrize("vocab", [VOCAB, 200_000, 12])  # keys of 4, 3 and 16 tokens
def test_lookups_agree_with_a_brute_force_scan(vocab):
    rng = random.Random(vocab)
    alphabet = [rng.randrange(vocab - 1) for _ in range(5)]  # few distinct tokens: long, many matches
    examples = [[rng.choice(alphabet) for _ in range(rng.randrange(2, 40))] for _ in range(30)]
    s = store(examples, vocab)
    checked = 0
    for _ in range(200):
        text = [rng.choice(alphabet) for _ in range(rng.randrange(1, 24))]
        best, follows = brute_force(examples, text)
        got = s.lookup(text, k=3, branches=len(alphabet) + 1)
        if best == 0:
            assert got == []
            continue
        assert all(c.match_len == best for c in got)
        if sum(follows.values()) <= MAX_MATCHES:  # otherwise the lookup looks at a subset of the matches
            checked += 1
            total = sum(follows.values())
            assert {c.tokens[0]: c.shares[0] for c in got} == \
                pytest.approx({t: n / total for t, n in follows.items() if t is not None})
    assert checked > 100


def dataset(folder, examples: list[tuple[list[int], list[int]]]):
    folder.mkdir()
    save_shard(folder / "shard_00000.npz", [p for p, _ in examples], [r for _, r in examples],
               ["h"] * len(examples), ["test"] * len(examples))
    (folder / "manifest.json").write_text(json.dumps({"shards": [{"file": "shard_00000.npz"}]}))


def test_build_save_load_round_trip(tmp_path):
    dataset(tmp_path / "data", [([1] * 20 + [2, 3], [4, 5, 6]), ([7], [8, 9])])
    tokens, meta = build_datastore(tmp_path / "data", VOCAB)
    sep = (1 << VOCAB.bit_length()) - 1
    assert tokens.tolist() == [1] * 14 + [2, 3, 4, 5, 6, sep, 7, 8, 9, sep]  # the prompt's last 16 tokens
    assert meta["examples"] == 2 and meta["response_tokens"] == 5
    for vocab in (VOCAB, 70_000):  # stored as uint16 and uint32
        save_datastore(tmp_path / f"s{vocab}.npz", tokens if vocab == VOCAB else np.where(tokens == sep, 131071, tokens),
                       vocab, meta)
        s = load_datastore(tmp_path / f"s{vocab}.npz", vocab)
        assert len(s) == len(tokens) and s.meta["examples"] == 2
        assert s.lookup([2, 3, 4], k=5)[0].tokens == [5, 6]
    with pytest.raises(D3DError, match="vocabulary of 49152 tokens; the target has 50000"):
        load_datastore(tmp_path / f"s{VOCAB}.npz", 50_000)
    with pytest.raises(D3DError, match="no datastore at"):
        load_datastore(tmp_path / "missing.npz")
    (tmp_path / "bad.npz").write_text("not a datastore")
    with pytest.raises(D3DError, match="is not a d3d datastore"):
        load_datastore(tmp_path / "bad.npz")
    with pytest.raises(D3DError, match="token ids >= the vocabulary size"):
        build_datastore(tmp_path / "data", 8)


def test_datastore_command(tmp_path, capsys, smol):
    dataset(tmp_path / "data", [([1, 2], [3, 4, 5])])
    out = tmp_path / "store.npz"
    assert main(["datastore", "--data", str(tmp_path / "data"), "--out", str(out)]) == 0
    assert "1 examples, 6 tokens" in capsys.readouterr().out
    assert load_datastore(out, VOCAB).meta["command"] == f"d3d datastore --data {tmp_path / 'data'} --out {out}"
    assert main(["datastore", "--data", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "no dataset at" in capsys.readouterr().err
    dataset(tmp_path / "code", [([6], [7, 8])])
    both = ["datastore", "--data", str(tmp_path / "data"), "--extra-data", str(tmp_path / "code"), "--out", str(out)]
    assert main(both) == 0
    assert "2 examples, 10 tokens" in capsys.readouterr().out
    sep = (1 << VOCAB.bit_length()) - 1
    s = load_datastore(out, VOCAB)
    assert s.tokens[:len(s)].tolist() == [1, 2, 3, 4, 5, sep, 6, 7, 8, sep] and s.meta["extra_data"] == [str(tmp_path / "code")]
    assert main([*both[:3], "--extra-data", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert f"no dataset at {tmp_path / 'nothing'}" in capsys.readouterr().err
    for command in (["generate", "hi", "--method", "lookup-tree"], ["serve", "--port", "0"]):
        assert main([*command, "--datastore", str(tmp_path / "no.npz")]) == 2
        assert "datastore file does not exist" in capsys.readouterr().err


def test_python_api_takes_the_tree_options(smol):
    from d3d import load

    gen = load(method="lookup-tree", threads=1, tree_budget=6, datastore="none")
    assert gen.method == "lookup-tree" and gen.generate("What is 2 + 2?", max_new_tokens=8)
    assert gen.runner.settings["tree_budget"] == 6 and gen.runner.settings["datastore"] is None
    with pytest.raises(D3DError, match="datastore file does not exist"):
        load(method="lookup-tree", datastore="/nonexistent.npz")
    with pytest.raises(D3DError, match="tree_budget must be >= 1"):
        load(method="lookup-tree", tree_budget=0)
