"""LoRA adapters against full fine-tuning on the embedded default (SmolLM2-135M-Instruct, movie reviews, VADER reward):
peak resident memory, seconds per update and the learning curves, side by side in one invocation.

    python benchmark/lora.py                                  # 40 updates each, seed 1 (~20 min on 2 CPU cores)
    python benchmark/lora.py --updates 4 --output lora.png    # a quick look

Each run is `python rloo.py` on the embedded default with --total_episodes = 16 x --updates, one after the other with
nothing else running; the LoRA run adds --use_peft and the options of --lora (by default adapters on every linear layer,
rank 16, and a learning rate of 3e-4: ten times the full run's, as LoRA usually needs). The peak resident memory is
each run's own maximum RSS (getrusage of the child); seconds per update: the mean of time/update over the updates
after the first (which warms up). The curves are drawn by benchmark/plot.py. glibc's malloc gives back blocks of 1 MiB
and more as they are freed (MALLOC_MMAP_THRESHOLD_), so that a peak is what the process held.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
LORA = "--use_peft --lora_target_modules all-linear --learning_rate 3e-4"
# glibc keeps freed blocks of up to 32 MiB in its heap, so that a peak RSS varies by GBs between identical runs
# (benchmark/multigpu_memory.py); blocks of 1 MiB and more are given back as they are freed: the peak is what was held
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def run(name: str, options: list[str], updates: int, seed: int, workdir: str) -> dict:
    """One run of rloo.py in workdir (its run folder runs/<name>__<seed>): its peak RSS, wall time and metrics."""
    command = [
        sys.executable,
        os.path.join(ROOT, "rloo.py"),
        "--total_episodes",
        str(16 * updates),
        "--seed",
        str(seed),
        "--run_name",
        f"{name}__{seed}",
        *options,
    ]
    start = time.perf_counter()
    with open(os.path.join(workdir, f"{name}.log"), "w+") as log:
        proc = subprocess.Popen(
            command,
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", **MALLOC},
        )
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status):
            log.seek(0)
            last = log.read().strip().splitlines()[-1:] or [""]
            sys.exit(f"lora.py: error: the {name} run failed (exit {os.waitstatus_to_exitcode(status)}): {last[0]}")
    peak = usage.ru_maxrss
    with open(os.path.join(workdir, "runs", f"{name}__{seed}", "metrics.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if "episode" in row]  # the updates' (not the evaluations')
    return {"peak_mib": peak / 1024, "wall": wall, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"lora.py: error: {message}")  # one line, no usage block
    parser.add_argument("--updates", type=int, default=40, help="updates of 16 completions per run (the default's 40)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lora", default=LORA, help=f"the LoRA run's options (default: {LORA})")
    parser.add_argument("--options", default="", help="options of both runs (another model, data or reward)")
    parser.add_argument("--output", default=None, help="draw the reward and KL curves of both runs to this PNG")
    parser.add_argument("--keep", default=None, help="keep the run folders here (default: a temporary folder)")
    cli = parser.parse_args()
    if cli.updates < 2:
        parser.error(f"--updates must be >= 2 (the first update warms up), got {cli.updates}")
    with tempfile.TemporaryDirectory() as scratch:
        workdir = cli.keep or scratch
        os.makedirs(workdir, exist_ok=True)
        both = shlex.split(cli.options)
        results = {
            "lora": run("lora", both + shlex.split(cli.lora), cli.updates, cli.seed, workdir),
            "full": run("full", both, cli.updates, cli.seed, workdir),
        }
        if cli.output:
            subprocess.run(
                [
                    sys.executable,
                    os.path.join(ROOT, "benchmark", "plot.py"),
                    "--runs",
                    os.path.join(workdir, "runs"),
                    "--regex",
                    "^(full|lora)__",
                    "--metrics",
                    "reward",
                    "kl",
                    "--output",
                    cli.output,
                ],
                check=True,
            )
    print(
        f"{'embedded default' if not both else cli.options}, {cli.updates} updates of 16 completions, seed "
        f"{cli.seed}; LoRA: {cli.lora}"
    )
    print(
        "| run | peak resident memory (MiB) | seconds per update | of which the update (s) | reward, first 10% -> "
        "last 10% | kl, last 10% | whole run (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, result in results.items():
        rows, tenth = result["rows"], max(1, len(result["rows"]) // 10)
        mean = lambda key, part: sum(r[key] for r in part) / len(part)  # noqa: E731
        later = rows[1:]
        print(
            f"| {name} | {result['peak_mib']:.0f} | {mean('time/update', later):.2f} | "
            f"{mean('time/policy_forward_backward', later) + mean('time/optimizer', later):.2f} | "
            f"{mean('reward', rows[:tenth]):.3f} -> {mean('reward', rows[-tenth:]):.3f} | "
            f"{mean('kl', rows[-tenth:]):.3f} | {result['wall']:.0f} |"
        )


if __name__ == "__main__":
    main()
