"""Padded against padding-free forwards (--padding_free) on a variable-length workload: seconds per update of each
training-time stage, and peak memory; or the embedded default run with each path.

    python benchmark/padding_free.py                  # SmolLM2-135M-Instruct, completions spread over 1..128 tokens
    python benchmark/padding_free.py --embedded       # `python rloo.py` (the embedded default), each path
    python benchmark/padding_free.py --embedded -- --max_completion_length 128   # ... with more arguments for rloo.py

The workload is the forward work of one update of rloo.py on --batch completions, each stage as rloo.py runs it,
with its own functions: prompts of the embedded dataset (--batch / G prompts, G = 4 completions each) under the chat
template, and completion lengths spread from 1 to --max_completion_length tokens, geometrically by default (many short,
a long tail; --spread even: evenly spaced), in random order (random token ids: the cost depends on the shape only);
about half the padded positions are then padding (the table says how many).

    old_logprobs, reference_forward  no-grad completion_logprobs in chunks of --local_rollout_forward_batch_size rows
    reward                           reward_model_scores of a reward model on the policy's backbone (random head)
    policy_forward_backward          per micro-batch of --per_device_train_batch_size rows (in the order of a shuffled
                                     minibatch): completion_logprobs with entropies under grad, backward of the mean

Each path runs in a process of its own, the two alternating --rounds times, each process timing --updates updates
after one of warm-up; the table gives the mean seconds per update of each stage. Peak memory: how far the resident
set (CPU; glibc maps every block of 64 KiB or more on its own, so that a freed tensor leaves it at once) or the
allocated memory (GPU) rose during the timed updates above what the loaded models hold.

--embedded runs `python rloo.py --total_episodes 16*N` (N updates of the embedded default: 4 prompts x 4, up to 32
tokens) with each path, alternating, and reads rloo.py's own stage timings (time/*) from metrics.jsonl, dropping the
first update of each run; --keep FOLDER keeps the runs (runs/<path>_<round>).
"""

import argparse
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from rich.console import Console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import rloo  # noqa: E402
from rloo_utils.models import disable_dropout, from_pretrained
from rloo_utils.generation import tokenize_prompts
from rloo_utils.scoring import reward_model_scores
from rloo_utils.packing import chunked_completion_logprobs, packing_layout  # noqa: E402

PATHS = ["padded", "padding_free"]
STAGES = ["old_logprobs", "reference_forward", "reward", "policy_forward_backward"]


def memory_now(device, peak: bool) -> int:
    """Bytes: allocated (GPU), or the resident set VmRSS / its peak VmHWM (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(("VmHWM:" if peak else "VmRSS:")))


def worker(path: str, cli) -> dict:
    """One process, one path: load the models, build the workload, time the stages of --updates updates."""
    from datasets import load_dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    policy = from_pretrained(AutoModelForCausalLM, cli.model).to(device)
    disable_dropout(policy)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)  # the initial policy, as rloo.py makes it
    config = from_pretrained(AutoConfig, cli.model)
    config.num_labels = 1
    reward_model = AutoModelForSequenceClassification.from_config(config)
    reward_model.load_state_dict(policy.state_dict(), strict=False)  # the backbone's weights; the head stays random
    reward_model = reward_model.to(device).eval().requires_grad_(False)
    tokenizer = from_pretrained(AutoTokenizer, cli.model)
    console = Console(quiet=True)
    wanted = path == "padding_free"
    packing = packing_layout(policy, wanted, False, console, "policy")
    # the scripts' choice: the padding-free path, or (--no_padding_free) the plain definition
    logprobs_of = (
        functools.partial(chunked_completion_logprobs, packing=packing) if wanted else rloo.completion_logprobs
    )
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    reward_packing = packing_layout(backbone, wanted, False, console, "reward model")
    if wanted and (packing is None or reward_packing is None):
        sys.exit(f"padding_free.py: {cli.model} cannot run padding-free here")

    prompts = load_dataset("json", data_files=os.path.join(ROOT, "data", "movie_reviews", "train.jsonl"))["train"][
        "prompt"
    ]
    G = 4
    prompt_ids, prompt_mask, _, _ = tokenize_prompts(
        tokenizer, [p for p in prompts[: cli.batch // G] for _ in range(G)], 512, device
    )  # (B, P)
    C = cli.max_completion_length
    spread = torch.logspace(0, 1, cli.batch, base=C) if cli.spread == "geometric" else torch.linspace(1, C, cli.batch)
    lengths = spread.round().long()[torch.randperm(cli.batch, generator=torch.Generator().manual_seed(1))]  # (B,)
    completion_ids = torch.randint(3, config.vocab_size, (cli.batch, C), generator=torch.Generator().manual_seed(2)).to(
        device
    )
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long().to(device)  # (B, C)
    real = int(prompt_mask.sum() + completion_mask.sum())

    def no_grad_logprobs(model):
        chunk = cli.local_rollout_forward_batch_size
        with torch.no_grad():
            return torch.cat(
                [
                    logprobs_of(
                        model,
                        prompt_ids[i : i + chunk],
                        prompt_mask[i : i + chunk],
                        completion_ids[i : i + chunk],
                        completion_mask[i : i + chunk],
                        1.0,
                    )
                    for i in range(0, cli.batch, chunk)
                ]
            )

    def reward():
        chunk = cli.local_rollout_forward_batch_size
        ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
        return torch.cat(
            [
                reward_model_scores(reward_model, ids[i : i + chunk], mask[i : i + chunk], reward_packing)
                for i in range(0, cli.batch, chunk)
            ]
        )

    def policy_forward_backward():
        policy.train()
        order = torch.randperm(cli.batch, generator=torch.Generator().manual_seed(3)).to(device)
        for start in range(0, cli.batch, cli.per_device_train_batch_size):
            idx = order[start : start + cli.per_device_train_batch_size]
            logprobs, _ = logprobs_of(
                policy,
                prompt_ids[idx],
                prompt_mask[idx],
                completion_ids[idx],
                completion_mask[idx],
                1.0,
                with_entropy=True,
            )
            mask = completion_mask[idx]
            (-(logprobs * mask).sum() / mask.sum().clamp(min=1) * len(idx) / cli.batch).backward()
        policy.zero_grad(set_to_none=False)

    stages = {
        "old_logprobs": lambda: no_grad_logprobs(policy.eval()),
        "reference_forward": lambda: no_grad_logprobs(reference),
        "reward": reward,
        "policy_forward_backward": policy_forward_backward,
    }
    for run in stages.values():  # warm-up
        run()
    held = memory_now(device, peak=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the resident set
    seconds = {stage: [] for stage in stages}
    for _ in range(cli.updates):
        for stage, run in stages.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[stage].append(time.perf_counter() - start)
    padded = cli.batch * (int(prompt_mask.any(0).sum()) + C)
    order = torch.randperm(cli.batch, generator=torch.Generator().manual_seed(3))  # as policy_forward_backward
    tokens = (prompt_mask.sum(1) + completion_mask.sum(1)).cpu()[order]
    step = cli.per_device_train_batch_size
    micro = [int(tokens[i : i + step].sum()) for i in range(0, cli.batch, step)]
    return {
        "seconds": {k: statistics.mean(v) for k, v in seconds.items()},
        "peak_mib": (memory_now(device, True) - held) / 2**20,
        "real_tokens": real,
        "micro_batch_tokens": micro,
        "padded_positions": padded,
        "packing": packing,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
    }


def variable_length(cli) -> None:
    results = {path: [] for path in PATHS}
    for _ in range(cli.rounds):
        for path in PATHS:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", path, *sys.argv[1:]],
                check=True,
                text=True,
                capture_output=True,
                env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
            )
            results[path].append(json.loads(out.stdout.splitlines()[-1]))
    first = results["padded"][0]
    print(
        f"{os.path.basename(cli.model)} on {first['device']}: {cli.batch} completions of 1..{cli.max_completion_length} "
        f"tokens ({cli.spread}), micro-batches of {cli.per_device_train_batch_size}, no-grad chunks of "
        f"{cli.local_rollout_forward_batch_size}; {first['real_tokens']} real tokens in {first['padded_positions']} padded "
        f"positions ({1 - first['real_tokens'] / first['padded_positions']:.0%} padding); padding-free layout "
        f"{results['padding_free'][0]['packing']!r}; mean of {cli.rounds} x {cli.updates} updates"
    )
    print(f"{'stage':<26}{'padded s':>10}{'padding-free s':>16}{'speed-up':>10}")
    for stage in STAGES:
        a, b = (statistics.mean(r["seconds"][stage] for r in results[p]) for p in PATHS)
        print(f"{stage:<26}{a:>10.3f}{b:>16.3f}{a / b:>9.2f}x")
    a, b = (statistics.mean(r["peak_mib"] for r in results[p]) for p in PATHS)
    print(f"{'peak memory (MiB)':<26}{a:>10.0f}{b:>16.0f}{a / b:>9.2f}x")
    micro = first["micro_batch_tokens"]
    print(
        f"real tokens per micro-batch: {micro} (heaviest {max(micro) / statistics.mean(micro):.2f}x the mean: what a "
        "token budget per micro-batch would even out)"
    )


def embedded(cli) -> None:
    rows = {path: [] for path in PATHS}
    with tempfile.TemporaryDirectory() as scratch:
        workdir = cli.keep or scratch
        os.makedirs(workdir, exist_ok=True)
        for round_ in range(cli.rounds):
            for path in PATHS:
                name = f"{path}_{round_}"
                subprocess.run(
                    [
                        sys.executable,
                        os.path.join(ROOT, "rloo.py"),
                        "--total_episodes",
                        str(16 * cli.updates),
                        "--run_name",
                        name,
                        "--num_sample_generations",
                        "0",
                        "--padding_free" if path == "padding_free" else "--no_padding_free",
                        *cli.rloo_args,
                    ],
                    cwd=workdir,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                with open(os.path.join(workdir, "runs", name, "metrics.jsonl")) as f:
                    rows[path] += [row for row in map(json.loads, f) if "episode" in row][1:]
    print(
        f"python rloo.py (the embedded default), {cli.updates} updates a run, {cli.rounds} runs of each path, "
        "the first update of each dropped"
    )
    print(f"{'stage':<26}{'padded s':>10}{'padding-free s':>16}{'speed-up':>10}")
    for stage in ["generation", *STAGES, "optimizer", "update"]:
        a, b = (statistics.mean(r.get("time/" + stage, 0.0) for r in rows[p]) for p in PATHS)
        print(f"{stage:<26}{a:>10.3f}{b:>16.3f}{a / b if b else float('nan'):>9.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"padding_free.py: error: {message}")  # one line, no usage block
    parser.add_argument(
        "--model", default=rloo.Args.model_name_or_path, help="policy (default: rloo.py's embedded one)"
    )
    parser.add_argument("--batch", type=int, default=16, help="completions per update")
    parser.add_argument("--max_completion_length", type=int, default=128)
    parser.add_argument(
        "--spread",
        choices=["geometric", "even"],
        default="geometric",
        help="completion lengths from 1 to the maximum: geometric (many short, a long tail, as RL "
        "completions are) or evenly spaced",
    )
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--local_rollout_forward_batch_size", type=int, default=16)
    parser.add_argument("--updates", type=int, default=1, help="timed updates per process (--embedded: per run)")
    parser.add_argument("--rounds", type=int, default=2, help="processes of each path, alternating")
    parser.add_argument("--embedded", action="store_true", help="time `python rloo.py` itself, with each path")
    parser.add_argument("--keep", default=None, help="--embedded: keep the runs here (default: a temporary folder)")
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("rloo_args", nargs="*", help="--embedded: more arguments for rloo.py (after --)")
    cli = parser.parse_args()
    for name in [
        "batch",
        "max_completion_length",
        "per_device_train_batch_size",
        "local_rollout_forward_batch_size",
        "updates",
        "rounds",
    ]:
        if getattr(cli, name) < 1:
            parser.error(f"--{name} must be 1 or more, got {getattr(cli, name)}")
    if cli.rloo_args and not cli.embedded:
        parser.error("arguments after -- go to rloo.py, which only --embedded runs")
    if cli.keep and not cli.embedded:
        parser.error("--keep keeps rloo.py's runs, which only --embedded makes")
    if cli.worker:
        print(json.dumps(worker(cli.worker, cli)))
    elif cli.embedded:
        embedded(cli)
    else:
        variable_length(cli)


if __name__ == "__main__":
    main()
