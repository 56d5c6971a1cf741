"""The sequence masks against no mask, on rollouts up to two updates old: rloo_vllm.py on the arithmetic task
(data/arithmetic, SmolLM2-135M-Instruct, the settings of benchmark/experiments/arithmetic_cpu.sh) against a vLLM server
with --max_staleness 2, the server pinned to one core and the trainer to the other (taskset), as async_timing.py runs.

Two runs on one server, one after the other, each with the off-policy correction on:
- no mask: truncated importance sampling per completion (--vllm_importance_sampling_mode sequence_truncate, the loss
  being one term per completion), which weights completions and leaves none out;
- masks: the geometric-mean mask (--vllm_importance_sampling_mode sequence_geometric_mask, bounds 0.99 1.01) and
  DeepSeek-V3.2's off-policy sequence mask (--vllm_off_policy_mask_threshold, 0.03 by default here), together.
Per run, over the updates after the first two (whose rollouts all come from the initial weights): the sampler-policy KL
per token (sampling/kl, its mean and largest), the share of completions each mask left out, the training reward.

    python benchmark/off_policy_masks.py                   # 12 updates per run
    python benchmark/off_policy_masks.py --preset tiny     # the test model on the tests' prompts (a check, in seconds)
"""

import argparse
import os
import signal
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
from async_timing import ONE_CORE, pinned, server_and_trainer_cores  # noqa: E402
from vllm_timing import hf_folder, run, start_server  # noqa: E402

ARITHMETIC = [
    *("--dataset_name", os.path.join(ROOT, "data", "arithmetic"), "--reward_funcs", "answer_accuracy"),
    *("--max_completion_length", "16", "--num_generations", "8", "--per_device_train_batch_size", "32"),
    *("--learning_rate", "3e-5", "--beta", "0.02", "--num_sample_generations", "0", "--eval_steps", "0"),
]
COLUMNS = [  # (label, metric, reduction over the updates, whether the no-mask run has it)
    ("sampler-policy KL per token, mean", "sampling/kl", statistics.mean, True),
    ("sampler-policy KL per token, largest", "sampling/kl", max, True),
    ("share of weights truncated", "sampling/importance_sampling_ratio/clipped_fraction", statistics.mean, True),
    (
        "share left out by the geometric mask",
        "sampling/importance_sampling_ratio/clipped_fraction",
        statistics.mean,
        False,
    ),
    ("share left out by the off-policy mask", "sampling/off_policy_masked_fraction", statistics.mean, False),
    ("training reward", "reward", statistics.mean, True),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"off_policy_masks.py: error: {message}")  # one line, no usage block
    parser.add_argument("--preset", choices=["tiny", "smollm2"], default="smollm2")
    parser.add_argument("--updates", type=int, default=12, help="updates per run; the first two are dropped")
    parser.add_argument("--max_staleness", type=int, default=2)
    parser.add_argument("--threshold", type=float, default=0.03, help="--vllm_off_policy_mask_threshold of the masks")
    cli = parser.parse_args()
    server_core, trainer_core = server_and_trainer_cores(parser, cli.updates)

    with tempfile.TemporaryDirectory() as workdir:
        model = hf_folder(cli.preset, workdir)
        task = ARITHMETIC
        if cli.preset == "tiny":  # the tests' prompts, rewarded by their length (the tiny model knows no arithmetic)
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from conftest import write_prompts

            rewards = os.path.join(ROOT, "tests", "reward_fixtures.py")
            prompts = write_prompts(os.path.join(workdir, "prompts.jsonl"))
            task = [*ARITHMETIC[4:], "--dataset_name", prompts, "--reward_funcs", f"{rewards}:text_length"]
            task[task.index("--learning_rate") + 1] = "3e-3"
        args = [*task, "--model_name_or_path", model, "--total_episodes", str(32 * cli.updates)]
        os.environ.update(ONE_CORE)  # the server's too
        server, url, server_start = start_server(model, workdir, lambda command: pinned(server_core, command))
        masks = ["--vllm_importance_sampling_mode", "sequence_geometric_mask"]
        masks += ["--vllm_off_policy_mask_threshold", str(cli.threshold)]
        results = []
        try:
            for name, extra in [
                ("no mask", ["--vllm_importance_sampling_mode", "sequence_truncate"]),
                ("masks", masks),
            ]:
                command = [sys.executable, os.path.join(ROOT, "rloo_vllm.py"), *args, "--max_staleness"]
                command += [str(cli.max_staleness), "--vllm_mode", "server", "--vllm_server_base_url", url]
                command += ["--vllm_importance_sampling_correction"]
                env = {**ONE_CORE, "TOKENIZERS_PARALLELISM": "false"}
                results.append(run(name, pinned(trainer_core, command + extra), workdir, drop=2, env=env))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait()

    print(
        f"preset {cli.preset}, --max_staleness {cli.max_staleness}: updates 3 to {cli.updates} of 32 completions; "
        f"the masks: geometric bounds 0.99 1.01, off-policy threshold {cli.threshold}; server start-up "
        f"{server_start:.1f} s"
    )
    print(f"{'':<40}" + "".join(f"{r['name']:>14}" for r in results))
    for label, key, reduce, unmasked in COLUMNS:
        values = [reduce([row[key] for row in r["rows"]]) if key in r["rows"][0] else None for r in results]
        shown = [values[0] if unmasked else None, None if label.startswith("share of weights") else values[1]]
        print(f"{label:<40}" + "".join(f"{v:>14.4f}" if v is not None else f"{'-':>14}" for v in shown))
    print(f"{'whole run, wall (s)':<40}" + "".join(f"{r['wall']:>14.1f}" for r in results))


if __name__ == "__main__":
    main()
