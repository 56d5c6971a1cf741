"""Generated tokens per second of rloo_vllm.py's colocated vLLM engine, with and without a seed per completion.

rloo_vllm.py gives every completion its own SamplingParams.seed (sampling_seeds: a resumed run draws the samples of
the uninterrupted one). vLLM then gives that request a torch.Generator of its own, which its sampler serves one request
at a time; a request without a seed shares the batch's random numbers. This script builds the engine exactly as
rloo_vllm.py does (ColocatedVLLM from a parsed Args, the policy's weights pushed) and times one rollout, the same
prompts (the dataset's first P, through tokenize_prompts) and sizes every time, seeded three ways:

    per-completion seed  P*G requests, seed = sampling_seeds(seed, update, row)   (rloo_vllm.py)
    no seed              P*G requests without a seed
    per-prompt seed, n=G P requests, SamplingParams(n=G, seed=s): vLLM seeds child i with s + i (a server's way)

No token ends a completion (no stop ids, EOS ignored): every completion is max_completion_length tokens, so the three
variants generate the same number of tokens. The variants alternate, repeat after repeat, after one untimed warm-up
each; the table gives generated tokens per second over the repeats (wall clock, and per CPU-second of this process,
which other load on the machine disturbs less), the ratio of medians to the first variant, and the fraction of groups
whose G completions are all the same.

Prompts are cut to --max_prompt_length tokens (16 by default): the rollout is decoding, as RL rollouts mostly are.

    python benchmark/vllm_sampling_seeds.py                    # the tests' tiny model (built in a temporary folder)
    python benchmark/vllm_sampling_seeds.py --preset smollm2   # SmolLM2-135M-Instruct, rloo_vllm.py's default model
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PRESETS = {
    "tiny": dict(prompts=64, num_generations=4, max_completion_length=128),
    "smollm2": dict(prompts=16, num_generations=4, max_completion_length=64),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"vllm_sampling_seeds.py: error: {message}")  # one line, no usage block
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny", help="model and default sizes (default tiny)"
    )
    parser.add_argument("--prompts", type=int, help="prompts per rollout, P (default: the preset's)")
    parser.add_argument("--num_generations", type=int, help="completions per prompt, G (default: the preset's)")
    parser.add_argument("--max_completion_length", type=int, help="tokens per completion (default: the preset's)")
    parser.add_argument("--max_prompt_length", type=int, default=16, help="prompts keep their last tokens (default 16)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rollouts per variant (default 5)")
    parser.add_argument("--seed", type=int, default=1, help="--seed of rloo_vllm.py")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=0)
    options = parser.parse_args()
    sizes = {k: getattr(options, k) or v for k, v in PRESETS[options.preset].items()}
    P, G, C = sizes["prompts"], sizes["num_generations"], sizes["max_completion_length"]

    import numpy as np
    import torch
    import tyro
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rloo_vllm
    from rloo_utils.vllm_colocated import ColocatedVLLM
    from rloo_utils.weight_transfer import weights_for_vllm
    from rloo_utils.generation import tokenize_prompts
    from rloo_utils.data import load_datasets
    from rloo_utils.models import embedded_model, from_pretrained
    from rloo_utils.vllm_sampling import sampling_options, sampling_seeds

    workdir = tempfile.TemporaryDirectory(prefix="vllm_sampling_seeds_")
    if options.preset == "tiny":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from conftest import build_tiny_models

        model = build_tiny_models(workdir.name)["policy"]
    else:
        model = embedded_model()
    args = tyro.cli(
        rloo_vllm.Args,
        use_underscores=True,
        args=[
            "--model_name_or_path",
            model,
            "--max_prompt_length",
            str(options.max_prompt_length),
            "--seed",
            str(options.seed),
            "--num_generations",
            str(G),
            "--max_completion_length",
            str(C),
            "--temperature",
            str(options.temperature),
            "--top_p",
            str(options.top_p),
            "--top_k",
            str(options.top_k),
        ],
    )
    tokenizer = from_pretrained(AutoTokenizer, args.model_name_or_path)
    policy = from_pretrained(AutoModelForCausalLM, args.model_name_or_path)
    train, _ = load_datasets(
        dataset_name=args.dataset_name,
        dataset_train_split=args.dataset_train_split,
        dataset_test_split=args.dataset_test_split,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    texts = train[[i % len(train) for i in range(P)]]["prompt"]  # from the top again if the dataset has fewer
    prompt_ids, prompt_mask, _, _ = tokenize_prompts(tokenizer, texts, args.max_prompt_length, torch.device("cpu"))
    prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]  # as the main loop hands them over
    rows = [p for p in prompts for _ in range(G)]  # group g is rows [g*G, (g+1)*G)
    started = time.perf_counter()
    engine = ColocatedVLLM(args, policy, torch.device("cpu"))
    engine.push_weights(policy, weights_for_vllm(policy, engine.dtype))  # as rloo_vllm.py pushes them
    print(
        f"{options.preset}: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M parameters, engine up in "
        f"{time.perf_counter() - started:.0f} s; rollout {P} prompts x G={G} x {C} tokens = {P * G * C} tokens, "
        f"{options.repeats} repeats, {torch.get_num_threads()} threads"
    )
    sampling = sampling_options(  # no end token: always C tokens
        [],
        greedy=False,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        generation_kwargs=args.generation_kwargs,
    )

    def per_prompt(update):
        from vllm import SamplingParams

        base = sampling_seeds(args.seed, update, 1)[0]
        params = [SamplingParams(**sampling, n=G, seed=base + j * G, detokenize=False) for j in range(P)]
        outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(c.token_ids) for out in outputs for c in out.outputs]

    variants = {
        "per-completion seed": lambda u: [
            ids for ids, _ in engine.generate(rows, sampling, sampling_seeds(args.seed, u, len(rows)))
        ],
        "no seed": lambda u: [ids for ids, _ in engine.generate(rows, sampling, None)],
        "per-prompt seed, n=G": per_prompt,
    }
    speeds = {name: [] for name in variants}  # generated tokens per wall-clock second
    cpu_speeds = {name: [] for name in variants}  # per CPU-second of this process: less sensitive to other load
    identical_groups = {name: [] for name in variants}
    for name, run in variants.items():
        run(0)  # warm-up
    for repeat in range(1, options.repeats + 1):
        for name, run in variants.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            out = run(repeat)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            tokens = sum(map(len, out))
            assert len(out) == P * G and tokens == P * G * C, (name, len(out), tokens)
            speeds[name].append(tokens / seconds)
            cpu_speeds[name].append(tokens / cpu_seconds)
            identical_groups[name].append(
                np.mean([len({tuple(ids) for ids in out[g * G : (g + 1) * G]}) == 1 for g in range(P)])
            )

    first = next(iter(variants))
    reference, cpu_reference = statistics.median(speeds[first]), statistics.median(cpu_speeds[first])
    print(
        f"{'variant':22s} {'tokens/s median':>16s} {'min':>8s} {'max':>8s} {'ratio':>6s} {'tokens/CPU-s median':>20s} "
        f"{'ratio':>6s} {'groups all identical':>21s}"
    )
    for name, values in speeds.items():
        cpu = statistics.median(cpu_speeds[name])
        print(
            f"{name:22s} {statistics.median(values):16.0f} {min(values):8.0f} {max(values):8.0f} "
            f"{statistics.median(values) / reference:6.2f} {cpu:20.0f} {cpu / cpu_reference:6.2f} "
            f"{float(np.mean(identical_groups[name])):21.3f}"
        )
    engine.close()
    workdir.cleanup()


if __name__ == "__main__":
    main()
