"""How much of retrieval's acceptance on code rests on the code in the distillation data.

Builds datastores from the shipped datastore's examples (the first 67 data shards) with all, 3/4, 1/2,
1/4 or none of the code-like examples (a response containing `def `, a code fence, `import `,
`return ` or "function"), as a control without as many random other examples, and, given
`--extra-data` (e.g. `d3d data --prompts code`), with all of that dataset added. Each is replayed
against the target's cached greedy continuations (`d3d estimate --cache`): every round takes the best
of the two retrieved continuations (up to 8 tokens) that matches the text, as a tree would verify
both; tau = matched + 1 per round.

    python scripts/retrieval_code_share.py --cache runs/heldout_continuations.json --out results/retrieval_code_share.json
    python scripts/retrieval_code_share.py --extra-data data/distill-code --out results/retrieval_code_data.json
"""
from __future__ import annotations

import argparse
import json
import random

from d3d.runtime.checkpoints import load_tokenizer, read_hf_config, resolve_target
from d3d.corpus.data import load_dataset
from d3d.atomic import atomic_write_json
from d3d.corpus.datastore import Datastore, example_tokens
from d3d.decoding.verify import leading_matches

CODE_MARKS = ("def ", "```", "import ", "function", "return ")


def retrieval_tau(store: Datastore, prompt: list[int], cont: list[int], k: int = 8) -> list[int]:
    taus, i = [], 0
    while i < len(cont):
        best = max((leading_matches(a == b for a, b in zip(c.tokens, cont[i:]))
                    for c in store.lookup(prompt + cont[:i], k, 2)), default=0)
        taus.append(best + 1)
        i += best + 1
    return taus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/distill")
    ap.add_argument("--max-shards", type=int, default=67)
    ap.add_argument("--cache", default="runs/heldout_continuations.json")
    ap.add_argument("--extra-data", default=None, help="a dataset to add whole, as its own row")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model_dir = resolve_target(None)
    tok, vocab_size = load_tokenizer(model_dir), read_hf_config(model_dir)["vocab_size"]
    examples = load_dataset(args.data, args.max_shards)
    code = [i for i, e in enumerate(examples) if any(m in tok.decode(e.response_ids) for m in CODE_MARKS)]
    other = sorted(set(range(len(examples))) - set(code))
    rng = random.Random(0)
    shuffled = rng.sample(code, len(code))
    dropped = {f"{share}_of_code": set(shuffled[:round(len(code) * (1 - share))]) for share in (1, 0.75, 0.5, 0.25, 0)}
    dropped["all_code_without_as_many_others"] = set(rng.sample(other, len(code)))
    extra = load_dataset(args.extra_data) if args.extra_data else []
    cont = json.load(open(args.cache))["max_new_tokens=128"]
    rows = {}
    if extra:
        dropped["all_plus_extra_data"] = set()
    for name, drop in dropped.items():
        kept = [e for i, e in enumerate(examples) if i not in drop] + (extra if name == "all_plus_extra_data" else [])
        store = Datastore(example_tokens(kept, vocab_size), vocab_size)
        per = {b: [t for p, c in items.values() for t in retrieval_tau(store, p, c)] for b, items in cont.items()}
        rows[name] = {"examples": len(kept), "tokens": len(store),
                      "tau": {b: round(sum(t) / len(t), 3) for b, t in per.items()}}
        print(name, rows[name])
    atomic_write_json(args.out, {"command": "python scripts/retrieval_code_share.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()), "code_examples": len(code),
        "examples": len(examples), "extra_examples": len(extra), "rows": rows})


if __name__ == "__main__":
    main()
