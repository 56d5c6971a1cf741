"""Time rloo.py updates split into their stages, so that time spent outside the stages is visible.

rloo.py logs the wall-clock seconds of each stage of every update (time/generation, time/old_logprobs,
time/reference_forward, time/reward, time/policy_forward_backward, time/optimizer) and of the whole update
(time/update). This script runs it for a few updates, drops the first (warm-up), and prints the mean of each stage
and the remainder, "other" = update - sum(stages): tokenisation, masks, advantages, logging.

    python benchmark/step_timing.py --preset tiny       # the ~0.4M-parameter model the tests build
    python benchmark/step_timing.py --preset smollm2    # SmolLM2-135M-Instruct, the workload of trl_baseline.py

Extra arguments after `--` go to rloo.py. The smollm2 preset is the same work as benchmark/trl_baseline.py:
8 completions per step (4 prompts x 2), up to 64 tokens, beta 0.05, lr 1e-6, fp32, one epoch, one minibatch.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["generation", "old_logprobs", "reference_forward", "reward", "policy_forward_backward", "optimizer"]
SAME_AS_TRL_BASELINE = [
    "--num_generations",
    "2",
    "--per_device_train_batch_size",
    "8",
    "--max_completion_length",
    "64",
    "--beta",
    "0.05",
    "--learning_rate",
    "1e-6",
    "--temperature",
    "1.0",
    "--num_sample_generations",
    "0",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"step_timing.py: error: {message}")  # one line, no usage block
    parser.add_argument("--preset", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--updates", type=int, default=6, help="updates to run; the first is dropped as warm-up")
    parser.add_argument("rloo_args", nargs="*", help="more arguments for rloo.py (after --)")
    cli = parser.parse_args()

    with tempfile.TemporaryDirectory() as workdir:
        args = [*SAME_AS_TRL_BASELINE, "--total_episodes", str(8 * cli.updates)]
        if cli.preset == "tiny":
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from conftest import build_tiny_models

            tiny = build_tiny_models(os.path.join(workdir, "tiny"))
            args += ["--model_name_or_path", tiny["policy"]]
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "rloo.py"), *args, *cli.rloo_args],
            cwd=workdir,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (run,) = os.listdir(os.path.join(workdir, "runs"))
        with open(os.path.join(workdir, "runs", run, "metrics.jsonl")) as f:
            rows = [row for row in map(json.loads, f) if "episode" in row][1:]

    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in rows)  # noqa: E731
    update = mean("time/update")
    print(
        f"rloo.py, preset {cli.preset}: mean of {len(rows)} updates after warm-up "
        f"({mean('completions/mean_length'):.1f} tokens per completion on average)"
    )
    print(f"{'stage':<26}{'seconds':>9}{'share':>8}")
    for stage in STAGES:
        print(f"{stage:<26}{mean('time/' + stage):>9.3f}{mean('time/' + stage) / update:>8.1%}")
    other = update - sum(mean("time/" + s) for s in STAGES)
    print(f"{'other':<26}{other:>9.3f}{other / update:>8.1%}")
    print(
        f"{'update':<26}{update:>9.3f}   (min {min(r['time/update'] for r in rows):.3f}, "
        f"{mean('perf/tokens_per_second'):.0f} tokens/s)"
    )


if __name__ == "__main__":
    main()
