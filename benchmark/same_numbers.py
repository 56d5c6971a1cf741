"""Whether a change to the code changed a number: seeded tiny-model runs of the three scripts, over the options that
take different paths through the loop, reduced to a digest (every logged metric but the wall-clock ones, the sample
tables, the final weights) that two checkouts must share bit for bit. A refactoring runs it before and after.

    python benchmark/same_numbers.py --out /tmp/before.json               # on the old code
    python benchmark/same_numbers.py --out /tmp/after.json --compare /tmp/before.json
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import build_tiny_models, write_jsonl, write_prompts  # noqa: E402

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")
WALL_CLOCK = ("eps", "step_time", "eval/seconds")


def configs(tiny: str, prompts: str, split: str) -> dict:
    """name -> (script, processes, options): each a path of the loop that the others do not take."""
    base = [
        *("--model_name_or_path", f"{tiny}/policy", "--dataset_name", prompts),
        *("--reward_funcs", f"{REWARDS}:text_length", "--total_episodes", 32, "--per_device_train_batch_size", 8),
        *("--max_completion_length", 8, "--learning_rate", 3e-3, "--num_sample_generations", 1, "--run_name", "run"),
    ]
    binary = ["--reward_funcs", f"{REWARDS}:first_token_is_a_multiple_of_4"]
    return {
        "default": ("rloo.py", 1, base + ["--beta", 0.1, "--log_completions"]),
        "ppo_token_grpo": (
            "rloo.py",
            1,
            base
            + ["--num_ppo_epochs", 2, "--num_mini_batches", 2, "--loss_type", "token", "--ppo_clip", "--dual_clip", 3]
            + ["--advantage_estimator", "grpo", "--token_level_kl", "--kl_estimator", "k3", "--beta", 0.1]
            + ["--missing_eos_penalty", 1, "--normalize_reward"],
        ),
        "gspo_reinforce_pp": (
            "rloo.py",
            1,
            base + ["--loss_type", "gspo", "--advantage_estimator", "reinforce_pp", "--num_ppo_epochs", 2],
        ),
        "sapo_dr_grpo_unpadded": (
            "rloo.py",
            1,
            base
            + ["--loss_type", "sapo", "--advantage_estimator", "dr_grpo", "--num_ppo_epochs", 2, "--no-padding_free"]
            + ["--loss_aggregation", "seq-mean-token-sum-norm", "--reward_clip_range", 2.5],
        ),
        "cispo_dynamic_token_budget": (
            "rloo.py",
            1,
            base
            + binary
            + ["--loss_type", "cispo", "--dynamic_sampling", "--max_sampling_rounds", 3]
            + ["--max_tokens_per_micro_batch", 40, "--max_prompt_length", 24, "--num_mini_batches", 2],
        ),
        "bfloat16_sampler_masks": (
            "rloo.py",
            1,
            base
            + ["--sampler_weights", "bfloat16", "--importance_sampling_mode", "sequence_mask"]
            + ["--off_policy_mask_threshold", 0.001, "--num_ppo_epochs", 2],
        ),
        "lora_reward_model": (
            "rloo.py",
            1,
            base + ["--use_peft", "--reward_model_path", f"{tiny}/reward", "--reward_weights", 1, 0.5],
        ),
        "evaluation": ("rloo.py", 1, base + ["--dataset_name", split, "--eval_steps", 1, "--num_generations_eval", 2]),
        "vllm_colocated": ("rloo_vllm.py", 1, base + ["--beta", 0.1, "--num_ppo_epochs", 2]),
        "fsdp_two_processes": ("rloo_multigpu.py", 2, base + ["--beta", 0.1, "--num_ppo_epochs", 2]),
        "fsdp_dynamic_sampling": (
            "rloo_multigpu.py",
            2,
            base + binary + ["--dynamic_sampling", "--max_sampling_rounds", 3, "--missing_eos_penalty", 0.5],
        ),
    }


def digest(run_dir: str) -> dict:
    """The run's metrics (the wall-clock ones left out), and hashes of its sample tables and final weights."""
    from safetensors.torch import load_file

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [
            {k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK and not k.startswith(("perf/", "time/"))}
            for line in f
        ]
    samples = (
        open(os.path.join(run_dir, "samples.jsonl"), "rb").read()
        if os.path.exists(os.path.join(run_dir, "samples.jsonl"))
        else b""
    )
    weights = hashlib.sha256()
    model = os.path.join(run_dir, "model")
    for name in sorted(n for n in os.listdir(model) if n.endswith(".safetensors")):
        tensors = load_file(os.path.join(model, name))
        for key in sorted(tensors):
            weights.update(key.encode() + tensors[key].float().numpy().tobytes())
    return {
        "metrics": metrics,
        "samples": hashlib.sha256(samples).hexdigest(),
        "weights": weights.hexdigest(),
    }


def run(script: str, processes: int, options: list, cwd: str) -> None:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, os.path.join(ROOT, script)]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        command.append(os.path.join(ROOT, script))
    proc = subprocess.run(command + list(map(str, options)), cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{script} {' '.join(map(str, options))} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where the digest is written (JSON)")
    parser.add_argument("--compare", help="a digest to compare with: the runs that differ are listed")
    parser.add_argument("--only", nargs="*", help="run these configurations only")
    cli = parser.parse_args()
    work = tempfile.mkdtemp(prefix="same_numbers_")
    build_tiny_models(os.path.join(work, "tiny"))
    prompts = write_prompts(os.path.join(work, "prompts.jsonl"))
    rows = [json.loads(line) for line in open(prompts)]
    split = os.path.join(work, "split")
    write_jsonl(os.path.join(split, "train.jsonl"), rows[:48])
    write_jsonl(os.path.join(split, "test.jsonl"), rows[48:54])
    result = {}
    for name, (script, processes, options) in configs(os.path.join(work, "tiny"), prompts, split).items():
        if cli.only and name not in cli.only:
            continue
        cwd = os.path.join(work, name)
        os.makedirs(cwd)
        start = time.time()
        run(script, processes, options, cwd)
        result[name] = digest(os.path.join(cwd, "runs", "run"))
        print(f"{name}: {time.time() - start:.0f} s, weights {result[name]['weights'][:12]}", flush=True)
    with open(cli.out, "w") as f:
        json.dump(result, f, indent=1)
    if cli.compare:
        expected = json.load(open(cli.compare))
        differ = [name for name in result if expected.get(name) != result[name]]
        for name in differ:
            old, new = expected.get(name, {}), result[name]
            parts = [k for k in ("metrics", "samples", "weights") if old.get(k) != new[k]]
            print(f"DIFFERS {name}: {', '.join(parts)}")
        print("the same numbers" if not differ else f"{len(differ)} of {len(result)} runs differ")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
