"""How close the quantized runtimes stay to fp32: teacher-forced on fp32's own greedy answers to held-out
prompts (HumanEval and MT-Bench first turns), the share of positions where the quantized target's greedy
token is fp32's, and the mean KL(fp32 || quantized) of the next-token distributions.

    python scripts/quantized_agreement.py --target Qwen2.5-Coder-1.5B-Instruct --modes int8,int4 \
        --out results/int4_agreement_pair_cpu.json

For a GGUF target, int4 loads the file's own 4-bit tensors (d3d.runtime.gguf_load), so it is compared
with the same file dequantized to fp32.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from d3d.atomic import atomic_path
from d3d.corpus.prompts import benchmark_prompts, encode_prompt, first_turn
from d3d.methods.catalog import make_runner
from d3d.runtime.kernels import runtime_info
from d3d.runtime.loading import load_target


@torch.no_grad()
def next_token_logits(model, seq: list[int], start: int) -> torch.Tensor:
    model.setup_cache(1, len(seq) + 8)
    return model(torch.tensor([seq]))[0, start - 1:-1].float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None)
    p.add_argument("--modes", default="int8,int4")
    p.add_argument("--limit", type=int, default=3, help="prompts per benchmark")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fp32, tok, model_dir = load_target(args.target)
    prompts = [encode_prompt(tok, first_turn(item)) for bench in ("humaneval", "mt-bench")
               for item in benchmark_prompts(bench, args.limit)]
    ar = make_runner("ar", fp32, tok, model_dir)
    seqs = [(ids + ar(ids, max_new_tokens=args.max_new_tokens).token_ids, len(ids)) for ids in prompts]
    reference = [next_token_logits(fp32, seq, start) for seq, start in seqs]
    del fp32, ar
    report = {"command": "python scripts/quantized_agreement.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "machine": runtime_info(quantized=True), "date": time.strftime("%Y-%m-%d"),
              "target": model_dir.name, "prompts": len(prompts), "positions": sum(len(r) for r in reference), "modes": {}}
    for mode in args.modes.split(","):
        model = load_target(args.target, quantize=mode)[0]
        agree, kl = [], []
        for (seq, start), ref in zip(seqs, reference):
            got = next_token_logits(model, seq, start)
            agree.append(got.argmax(-1) == ref.argmax(-1))
            kl.append(torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                                 reduction="none").sum(-1))
        report["modes"][mode] = {"greedy_agreement": round(torch.cat(agree).float().mean().item(), 4),
                                 "mean_kl": round(torch.cat(kl).mean().item(), 5)}
        print(mode, report["modes"][mode], flush=True)
        del model
    with atomic_path(args.out) as tmp:
        tmp.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
