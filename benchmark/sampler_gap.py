"""The gap between the sampler and the trainer when a copy of the policy in other numerics samples (--sampler_weights):
per token and per completion |log pi_trainer - log pi_sampler| of sampled completions, for a bfloat16 and a float16
copy, beside the gap that bfloat16 autocast alone makes against float32.

    python benchmark/sampler_gap.py                      # SmolLM2-135M-Instruct (the embedded default), 8 x 32 tokens
    python benchmark/sampler_gap.py --completions 32 --length 256 --model MODEL   # on a GPU: the kit's workload

The trainer is rloo.py's default on a GPU: float32 weights under bfloat16 autocast (--bf16). The completions are sampled
from the policy's float32 weights at temperature 1 (the same completions are scored by each model), the log-probs are
rloo.py's completion_logprobs (the definition). Qi et al. 2025 (arXiv 2510.26788) find float16's 10 mantissa bits
shrink the mismatch that bfloat16's 7 make; float16's range (65504) is the risk, so the largest activation is shown.
"""

import argparse
import contextlib
import functools
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import rloo  # noqa: E402
from rloo_utils.models import embedded_model, from_pretrained  # noqa: E402
from rloo_utils.off_policy import sampling_copy  # noqa: E402

PROMPTS = [
    "Write a short review of a film you liked.",
    "Explain why the sky is blue in two sentences.",
    "What is 17 times 23? Think step by step.",
    "Give three tips for a first marathon.",
]


def largest_activation(model, ids) -> float:
    """The largest |output| of any decoder layer on these ids: what float16 must hold."""
    largest = []
    hooks = [
        layer.register_forward_hook(lambda m, i, out: largest.append(float(out[0].abs().max())))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return max(largest)


def gap(trainer, sampler, n_tokens, n_completions) -> dict:
    """Mean |difference| per token and per completion (summed over its tokens), and the largest per token."""
    per_token = (trainer - sampler).abs()
    return {
        "per token": float(per_token.sum() / n_tokens),
        "per completion": float((trainer - sampler).sum(1).abs().sum() / n_completions),
        "max per token": float(per_token.max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=embedded_model(), help="a hub id, a folder or a .gguf file")
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--length", type=int, default=32, help="tokens sampled per completion")
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy = from_pretrained(AutoModelForCausalLM, cli.model, dtype=torch.float32).to(device).eval()
    tokenizer = from_pretrained(AutoTokenizer, cli.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(cli.completions)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
    torch.manual_seed(cli.seed)
    with torch.no_grad():
        out = policy.generate(
            **batch, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=cli.length, min_new_tokens=cli.length
        )
    completion_ids = out[:, batch["input_ids"].shape[1] :]  # (B, C): no stop, every token counts
    completion_mask = torch.ones_like(completion_ids)
    n_tokens, n_completions = completion_mask.sum(), len(completion_ids)
    logprobs_of = functools.partial(
        rloo.completion_logprobs,
        prompt_ids=batch["input_ids"],
        prompt_mask=batch["attention_mask"],
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        temperature=1.0,
    )
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    with torch.no_grad():
        float32 = logprobs_of(policy).double()
        with autocast():
            trainer = logprobs_of(policy).double()  # rloo.py's default on a GPU
        rows = {"bfloat16 autocast (the trainer) against float32": gap(float32, trainer, n_tokens, n_completions)}
        for dtype in (torch.bfloat16, torch.float16):
            copy = sampling_copy(policy, dtype)
            with contextlib.nullcontext():  # a copy computes in its own dtype
                sampler = logprobs_of(copy).double()
            name = str(dtype).removeprefix("torch.")
            rows[f"a {name} copy (the sampler) against the trainer"] = gap(trainer, sampler, n_tokens, n_completions)
            del copy
    print(f"{cli.model}: {n_completions} completions x {cli.length} tokens, {device.type}")
    print(f"largest decoder-layer activation: {largest_activation(policy, out):.1f} (float16 holds up to 65504)\n")
    print("| | per token | per completion | max per token |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['per token']:.4f} | {row['per completion']:.3f} | {row['max per token']:.3f} |")


if __name__ == "__main__":
    main()
