"""Kill a run with SIGKILL after a checkpoint, resume it, and check it against the same run never interrupted.

Runs rloo.py three times as subprocesses in --out: the reference run of 2N updates; the same run (checkpoint every N
updates) killed with SIGKILL once update N+1 is logged; and its resume with `--resume_from_checkpoint latest`. Then
it compares every logged metric except wall-clock ones, the sample tables and the final weights, and reports the
size of a checkpoint and how long writing it took.

    python benchmark/resume_check.py --preset smollm2   # the embedded default (SmolLM2-135M-Instruct, VADER), N = 2
    python benchmark/resume_check.py --preset tiny      # the test model, N = 3

Extra arguments after `--` go to every rloo.py run.
"""

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import WORDS, build_tiny_models, run_outcome, write_jsonl  # noqa: E402

PRESETS = {
    # (arguments, N): 2N updates, a checkpoint every N
    "smollm2": (
        [
            "--total_episodes",
            "64",
            "--per_device_train_batch_size",
            "8",
            "--num_mini_batches",
            "2",
            "--max_completion_length",
            "16",
            "--num_sample_generations",
            "2",
        ],
        2,
    ),
    "tiny": (
        [
            "--total_episodes",
            "48",
            "--per_device_train_batch_size",
            "4",
            "--num_mini_batches",
            "2",
            "--num_ppo_epochs",
            "2",
            "--max_completion_length",
            "8",
            "--learning_rate",
            "3e-3",
            "--beta",
            "0.1",
            "--num_sample_generations",
            "2",
        ],
        3,
    ),
}


def tiny_setup(out: str) -> list[str]:
    build_tiny_models(os.path.join(out, "tiny"))
    rng = random.Random(1)
    data = write_jsonl(
        os.path.join(out, "tiny", "prompts.jsonl"),
        [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))} for _ in range(64)],
    )
    return [
        "--model_name_or_path",
        os.path.join(out, "tiny", "policy"),
        "--dataset_name",
        data,
        "--reward_funcs",
        os.path.join(ROOT, "tests", "reward_fixtures.py:slow_text_length"),
    ]


def logged_updates(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    return sum('"episode"' in line for line in open(path)) if os.path.exists(path) else 0  # (not the evaluations)


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"resume_check.py: error: {message}")  # one line, no usage block
    parser.add_argument("--preset", choices=PRESETS, default="smollm2")
    parser.add_argument("--out", default="resume_check", help="working folder (emptied first)")
    parser.add_argument("extra", nargs="*", help="after --: more rloo.py arguments")
    cli = parser.parse_args()
    cli.out = os.path.abspath(cli.out)
    shutil.rmtree(cli.out, ignore_errors=True)
    os.makedirs(cli.out)
    preset, n = PRESETS[cli.preset]
    args = preset + (tiny_setup(cli.out) if cli.preset == "tiny" else []) + ["--save_steps", str(n)] + cli.extra
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    command = lambda name, *more: [sys.executable, os.path.join(ROOT, "rloo.py"), *args, "--run_name", name, *more]  # noqa: E731

    start = time.time()
    reference = subprocess.run(command("reference"), cwd=cli.out, env=env, capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr[-3000:]
    reference_minutes = (time.time() - start) / 60

    killed_dir = os.path.join(cli.out, "runs", "killed")
    with open(os.path.join(cli.out, "killed.log"), "w") as log:
        proc = subprocess.Popen(command("killed"), cwd=cli.out, env=env, stdout=log, stderr=log)
        while logged_updates(killed_dir) <= n:
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rows_at_kill = logged_updates(killed_dir)
    resumed = subprocess.run(
        command("killed", "--resume_from_checkpoint", "latest"), cwd=cli.out, env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    (metrics_a, samples_a, weights_a), (metrics_b, samples_b, weights_b) = (
        run_outcome(os.path.join(cli.out, "runs", "reference")),
        run_outcome(killed_dir),
    )
    checkpoint = os.path.join(killed_dir, "checkpoints", f"checkpoint-{n}")
    save_seconds = [float(s) for s in re.findall(r"wrote \S+ in ([\d.]+) s", " ".join(reference.stdout.split()))]
    print(
        f"preset {cli.preset}: {2 * n} updates, checkpoint every {n}; killed (SIGKILL) with {rows_at_kill} updates "
        f"logged, resumed from checkpoint-{n}"
    )
    print(
        f"  metrics identical at every step (wall-clock ones aside): {metrics_a == metrics_b} "
        f"({len(metrics_b)} rows, episodes {[r['episode'] for r in metrics_b]})"
    )
    print(f"  sample tables identical: {samples_a == samples_b}")
    print(
        f"  final weights identical: {all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)} "
        f"({len(weights_a)} tensors)"
    )
    print(
        f"  checkpoint: {folder_mb(checkpoint):.0f} MiB (policy {folder_mb(os.path.join(checkpoint, 'policy')):.0f} "
        f"MiB, training state {os.path.getsize(os.path.join(checkpoint, 'training_state.pt')) / 2**20:.0f} MiB), "
        f"written in {', '.join(f'{s:.2f}' for s in save_seconds)} s"
    )
    print(f"  reference run: {reference_minutes:.1f} min")


if __name__ == "__main__":
    main()
