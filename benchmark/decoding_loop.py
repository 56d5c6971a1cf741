"""HF generate's decoding loop against our own (rloo_utils/decoding.py, --decoding_loop own), both with the static KV
cache and a compiled step, side by side in one process: the same prompts, the same configs, alternating.

    python benchmark/decoding_loop.py                       # SmolLM2-135M-Instruct (the embedded default), 16 rows
    python benchmark/decoding_loop.py --model tiny          # the tests' ~2M-parameter Llama
    python benchmark/decoding_loop.py --rows 32 --new_tokens 256 --dtype bfloat16   # on a GPU: the kit's shape

Each path's first call of each config (sampling at temperature 1, greedy) traces and builds its compiled step (its
seconds are printed apart); then `--rounds` rounds, each timing one call of each path, alternating. Per call: the
seconds, the tokens each row was given (the output's columns: HF generate stops after the step in which the last row
ended; ours at its first read of the rows after that, every decoding.CHECK_EVERY steps, and drops the extra columns),
and the milliseconds per decoding step. Greedy outputs are checked equal. Random prompts of `--prompt_length` ids;
completions stop at the model's EOS (`--ignore_eos`: never, so every call makes `--new_tokens`).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rloo_utils import decoding  # noqa: E402
from rloo_utils.models import embedded_model, from_pretrained
from rloo_utils.generation import SamplingFilters, generation_configs, static_cache_inputs


def load(model: str, dtype: str, device):
    """The policy and its tokenizer: `tiny` builds the tests' model in a temporary folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model == "tiny":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from conftest import build_tiny_models

        model = build_tiny_models(tempfile.mkdtemp(prefix="decoding-loop-"))["policy"]
    policy = from_pretrained(AutoModelForCausalLM, model, dtype=getattr(torch, dtype)).to(device).eval()
    tokenizer = from_pretrained(AutoTokenizer, model)
    return policy, tokenizer


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(generate, inputs: dict, config, seed: int, device) -> tuple[float, torch.Tensor]:
    torch.manual_seed(seed)
    synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = generate(**inputs, generation_config=config)
    synchronize(device)
    return time.perf_counter() - start, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=embedded_model(), help="a hub id, folder or .gguf file; tiny: the tests'")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt_length", type=int, default=48)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--ignore_eos", action="store_true", help="no stop token: every call makes --new_tokens")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    options = parser.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy, tokenizer = load(options.model, options.dtype, device)
    # --ignore_eos: an id past the output layer's, which no row ever writes
    stop_ids = [policy.get_output_embeddings().weight.shape[0] if options.ignore_eos else tokenizer.eos_token_id]
    sampling, greedy, _ = generation_configs(
        stop_ids,
        tokenizer.pad_token_id,
        None,
        static=True,
        max_completion_length=options.new_tokens,
        temperature=1.0,
        eval_temperature=None,
        filters=SamplingFilters(top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, generation_kwargs=None),
    )
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, len(tokenizer) - 1, (options.rows, options.prompt_length), generator=generator)
    mask = torch.ones_like(ids)
    paths = {"HF generate": policy.generate, "own loop": lambda **inputs: decoding.generate(policy, **inputs)}

    print(
        f"{options.model} ({sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M parameters, {options.dtype}) on "
        f"{device}, {torch.get_num_threads()} threads: {options.rows} rows of {options.prompt_length} prompt tokens, "
        f"up to {options.new_tokens} new tokens, static cache, decoding.CHECK_EVERY {decoding.CHECK_EVERY}"
    )
    for name, config in (("sampling", sampling), ("greedy", greedy)):
        inputs = static_cache_inputs(ids.to(device), mask.to(device), config, options.rows)
        assert decoding.covers(policy, generation_config=config, **inputs)
        calls, outputs = {path: [] for path in paths}, {}  # (seconds, tokens a row) of each timed call
        for path, generate in paths.items():  # the first call of each: compiled
            first, outputs[path] = timed(generate, inputs, config, 0, device)
            print(f"  {name}, {path}: first call (tracing and building its compiled step) {first:.1f} s")
        for r in range(options.rounds):
            for path, generate in paths.items():
                elapsed, outputs[path] = timed(generate, inputs, config, r + 1, device)
                calls[path].append((elapsed, outputs[path].shape[1] - options.prompt_length))
        if name == "greedy":
            assert torch.equal(outputs["HF generate"], outputs["own loop"]), "greedy outputs differ"
        print(f"{name}: median of {options.rounds} calls" + (" (greedy outputs equal)" if name == "greedy" else ""))
        for path in paths:
            seconds = [s for s, _ in calls[path]]
            print(
                f"  {path:12s} {statistics.median(seconds):8.3f} s a call (min {min(seconds):.3f})  "
                f"{statistics.mean(n for _, n in calls[path]):6.1f} tokens a row  "
                f"{1000 * statistics.median(s / n for s, n in calls[path]):7.2f} ms a step"
            )
        ratio = statistics.median(s for s, _ in calls["HF generate"]) / statistics.median(
            s for s, _ in calls["own loop"]
        )
        print(f"  own loop: {ratio:.2f}x HF generate's speed (seconds a call)")


if __name__ == "__main__":
    main()
