"""Micro-batches of fixed rows against micro-batches by token budget (--max_tokens_per_micro_batch): seconds per update
and peak memory, side by side in one run.

    python benchmark/token_budget.py --task embedded     # rloo.py's embedded default (SmolLM2-135M-Instruct, 16 rows)
    python benchmark/token_budget.py --task arithmetic   # data/arithmetic, groups of 8, 32 rows an update

Each setting is a fresh rloo.py process of --updates updates (the first dropped as warm-up), the settings taken in
turn --repeats times (A B C D A B C D ...), so that a slow minute of the machine falls on all of them. Per setting:
the median seconds of an update and of its policy forward/backward, the micro-batches of an optimizer step, the most
tokens one of them held (prompt + completion: what a step's activations scale with), and the process's peak resident
set (VmHWM, glibc told to return freed blocks of 64 KiB or more at once, as benchmark/logprob_memory.py does).

The settings: the task's own rows in one micro-batch, and the budget that holds them (budget = rows x the longest row
the options allow: the guarantee fixed rows give); a quarter of the rows per micro-batch, and the budget of the same
guarantee; and a quarter of an update's tokens as measured (what a quarter of the rows holds on average, not in the
worst case; at least the longest row).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# rows an update, the longest row the options allow, rloo.py's options (no held-out evaluation: only updates run)
TASKS = {
    "embedded": (16, 256 + 32, ["--eval_steps", "0"]),
    "arithmetic": (
        32,
        64 + 16,
        [
            *("--dataset_name", os.path.join(ROOT, "data", "arithmetic"), "--reward_funcs", "answer_accuracy"),
            *("--max_completion_length", "16", "--num_generations", "8", "--max_prompt_length", "64"),
            *("--learning_rate", "3e-5", "--beta", "0.02", "--eval_steps", "0"),
        ],
    ),
}


def settings(rows: int, longest: int, mean_quarter: int) -> dict[str, list[str]]:
    quarter = rows // 4
    fixed = ["--per_device_train_batch_size", str(quarter), "--gradient_accumulation_steps", "4"]
    return {
        f"{rows} rows": ["--per_device_train_batch_size", str(rows)],
        f"budget {rows * longest} ({rows} x {longest})": [
            *("--per_device_train_batch_size", str(rows), "--max_tokens_per_micro_batch", str(rows * longest))
        ],
        f"{quarter} rows x 4": fixed,
        f"budget {quarter * longest} ({quarter} x {longest})": [
            *fixed,
            *("--max_tokens_per_micro_batch", str(quarter * longest)),
        ],
        f"budget {max(mean_quarter, longest)} (a quarter of an update's tokens)": [
            *fixed,
            *("--max_tokens_per_micro_batch", str(max(mean_quarter, longest))),
        ],
    }


def run(options: list[str], updates: int, rows: int, workdir: str) -> dict:
    """One rloo.py process: its logged updates after the first, the prompt and completion tokens of an update, and its
    peak resident set (GiB)."""
    command = [sys.executable, os.path.join(ROOT, "rloo.py"), *options]
    command += ["--total_episodes", str(rows * updates), "--num_sample_generations", "0", "--run_name", "run"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(dir=workdir) as cwd:
        with open(os.path.join(cwd, "stderr"), "w+") as stderr:
            proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak, not the largest child's so far
            if os.waitstatus_to_exitcode(status):
                stderr.seek(0)
                sys.exit(f"token_budget.py: rloo.py failed: {stderr.read().strip().splitlines()[-1:]}")
        with open(os.path.join(cwd, "runs", "run", "metrics.jsonl")) as f:
            logged = [row for row in map(json.loads, f) if "episode" in row]
    tokens = [b["num_tokens"] - a["num_tokens"] for a, b in zip(logged, logged[1:])]
    return {"rows": logged[1:], "tokens_per_update": statistics.mean(tokens), "peak_rss_gib": usage.ru_maxrss / 2**20}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"token_budget.py: error: {message}")  # one line, no usage block
    parser.add_argument("--task", choices=sorted(TASKS), default="embedded")
    parser.add_argument("--updates", type=int, default=5, help="updates a run; the first is dropped as warm-up")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting, taken in turn")
    parser.add_argument(
        "--mean_quarter", type=int, default=None, help="the mean-budget setting's tokens (default: measured)"
    )
    cli = parser.parse_args()
    if cli.updates < 2 or cli.repeats < 1:
        parser.error("--updates must be >= 2 (the first is dropped) and --repeats >= 1")
    rows, longest, options = TASKS[cli.task]
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        first = run([*options, "--per_device_train_batch_size", str(rows)], cli.updates, rows, workdir)
        mean_quarter = cli.mean_quarter or int(first["tokens_per_update"] / 4)  # a quarter of an update's tokens
        for repeat in range(cli.repeats):
            for name, extra in settings(rows, longest, mean_quarter).items():
                if repeat == 0 and name == f"{rows} rows":
                    outcome = first
                else:
                    outcome = run([*options, *extra], cli.updates, rows, workdir)
                results.setdefault(name, []).append(outcome)
                print(f"  {name}: run {repeat + 1} done", file=sys.stderr)
    print(
        f"rloo.py, task {cli.task}: {rows} completions an update, {cli.updates - 1} updates a run after warm-up, "
        f"{cli.repeats} runs a setting (medians over every run's updates)"
    )
    print(
        "| micro-batches | seconds / update | policy forward+backward s | micro-batches / step | "
        "most tokens in one | peak resident set GiB |"
    )
    print("|---|---|---|---|---|---|")
    for name, outcomes in results.items():
        logged = [r for outcome in outcomes for r in outcome["rows"]]
        median = lambda key: statistics.median(r[key] for r in logged)  # noqa: E731
        peak = max(outcome["peak_rss_gib"] for outcome in outcomes)
        print(
            f"| {name} | {median('time/update'):.2f} | {median('time/policy_forward_backward'):.2f} | "
            f"{median('perf/micro_batches_per_step'):.1f} | {max(r['perf/micro_batch_tokens_max'] for r in logged):.0f} | "
            f"{peak:.2f} |"
        )


if __name__ == "__main__":
    main()
