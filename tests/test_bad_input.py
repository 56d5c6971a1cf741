"""Bad input: a one-line error naming the problem, a non-zero exit, no traceback, and nothing overwritten."""

import os

import pytest

from conftest import ROOT, check_one_line_error, run_rloo, write_jsonl

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")


# Checks made before any model loads: the model path given is one that does not exist, so reaching a load would
# fail with a different message.
EARLY = [
    (["--num_generations", 1], ["--num_generations must be >= 2"]),
    (["--num_generations", 3, "--per_device_train_batch_size", 8], ["must be divisible by --num_generations 3"]),
    (["--learning_rate", -1], ["--learning_rate must be > 0"]),
    (["--temperature", 0], ["--temperature must be > 0"]),
    (["--top_p", 1.5], ["--top_p must be in (0, 1]"]),
    (["--epsilon", 1.5], ["--epsilon must be < 1"]),
    (["--beta", -0.1], ["--beta must be >= 0"]),
    (["--total_episodes", 4], ["--total_episodes 4 is smaller than one rollout batch (16)"]),
    (["--reward_clip_range", 2, 1], ["--reward_clip_range needs lo < hi"]),
    (["--reward_weights", 1, 2], ["--reward_weights has 2 values for 1 reward sources"]),
    (["--reward_funcs", "no_such_reward"], ["unknown reward function 'no_such_reward'"]),
    (["--reward_funcs", f"{REWARDS}:no_such_function"], ["has no function 'no_such_function'"]),
    (["--reward_funcs", "/nowhere/rewards.py:f"], ["reward function file /nowhere/rewards.py does not exist"]),
    (["--reward_model_path", "/nowhere/rm"], ["--reward_model_path /nowhere/rm does not exist"]),
    (["--dataset_name", "/nowhere/data.jsonl"], ["--dataset_name /nowhere/data.jsonl does not exist"]),
    # The combinations seed 002 rules out, and the ones that contradict themselves
    (["--advantage_normalization", "batch"], ["--advantage_estimator rloo does not take batch normalisation"]),
    (["--normalize_advantages"], ["--advantage_estimator rloo does not take batch normalisation"]),
    (["--advantage_estimator", "dr_grpo", "--advantage_normalization", "batch"],
     ["--advantage_estimator dr_grpo does not take batch normalisation"]),
    (["--advantage_estimator", "reinforce_pp", "--advantage_normalization", "group"],
     ["reinforce_pp needs batch normalisation", "got --advantage_normalization group"]),
    (["--advantage_estimator", "reinforce_pp", "--advantage_normalization", "none"], ["reinforce_pp needs batch normalisation"]),
    (["--advantage_estimator", "grpo", "--normalize_advantages", "--advantage_normalization", "group"],
     ["--normalize_advantages means --advantage_normalization batch"]),
    (["--loss_type", "cispo", "--ppo_clip"], ["--loss_type cispo has its own ratio handling"]),
    (["--loss_type", "gspo", "--ppo_clip"], ["--loss_type gspo has its own ratio handling"]),
    (["--loss_type", "sapo", "--ppo_clip"], ["--loss_type sapo has its own ratio handling"]),
    (["--ppo_clip"], ["--loss_type sequence clips its sequence ratio already"]),
    (["--loss_type", "token", "--dual_clip", 3], ["--dual_clip is part of PPO clipping: add --ppo_clip"]),
    (["--loss_type", "token", "--ppo_clip", "--dual_clip", 0.5], ["--dual_clip must be > 1"]),
    (["--loss_aggregation", "token-mean"], ["--loss_aggregation applies to token-level losses"]),
    (["--loss_type", "token", "--sapo_tau_pos", 2], ["gate temperatures of --loss_type sapo"]),
    (["--loss_type", "sapo", "--sapo_tau_neg", 0], ["--sapo_tau_neg must be > 0"]),
    (["--epsilon", 0], ["--epsilon must be > 0"]),
    # Checkpoints
    (["--save_steps", -1], ["--save_steps must be >= 0"]),
    (["--save_total_limit", 0], ["--save_total_limit must be >= 1"]),
    (["--max_skipped_steps", 0], ["--max_skipped_steps must be > 0"]),
    (["--resume_from_checkpoint", "latest"], ["--resume_from_checkpoint latest needs --run_name"]),
    (["--resume_from_checkpoint", "/nowhere/checkpoint-3"], ["/nowhere/checkpoint-3 does not exist (--resume_from_checkpoint /nowhere/checkpoint-3)"]),
    (["--resume_from_checkpoint", "latest", "--run_name", "nothing_here"], ["runs/nothing_here does not exist (--resume_from_checkpoint latest --run_name nothing_here)"]),
]


@pytest.mark.parametrize("extra,needles", EARLY, ids=[" ".join(map(str, e)) for e, _ in EARLY])
def test_checked_before_models_load(extra, needles, prompts_file, tmp_path):
    # A policy path that would fail to load proves the check came first, unless the check is about that path.
    proc = run_rloo("--model_name_or_path", tmp_path, "--dataset_name", prompts_file, *extra, cwd=tmp_path)
    check_one_line_error(proc, *needles)


def test_missing_model_path(prompts_file, tmp_path):
    check_one_line_error(run_rloo("--model_name_or_path", "/nowhere/model", "--dataset_name", prompts_file,
                                  cwd=tmp_path), "--model_name_or_path /nowhere/model does not exist")


def test_folder_that_is_not_a_model(prompts_file, tmp_path):
    check_one_line_error(run_rloo("--model_name_or_path", tmp_path, "--dataset_name", prompts_file, cwd=tmp_path),
                         "could not load", str(tmp_path))


def test_dataset_without_prompt_column(tiny, tmp_path):
    data = write_jsonl(str(tmp_path / "d.jsonl"), [{"question": "x"}])
    check_one_line_error(run_rloo("--model_name_or_path", tiny["policy"], "--dataset_name", data, cwd=tmp_path),
                         "has no 'prompt' column", "question")


def test_empty_dataset(tiny, tmp_path):
    data = tmp_path / "empty.csv"
    data.write_text("prompt\n")
    check_one_line_error(run_rloo("--model_name_or_path", tiny["policy"], "--dataset_name", data, cwd=tmp_path),
                         "is empty")


def test_missing_split(tiny, prompts_file, tmp_path):
    check_one_line_error(run_rloo("--model_name_or_path", tiny["policy"], "--dataset_name", os.path.dirname(prompts_file),
                                  "--dataset_train_split", "nope", cwd=tmp_path), "has no split 'nope'")


@pytest.mark.parametrize("func,needle", [
    ("raises", "reward function raises raised RuntimeError: the judge is down"),
    ("wrong_count", "reward function wrong_count must return a list of 16 floats (or None), got 15 values"),
    ("returns_nan", "reward function returns_nan returned nan at index 0; return None"),
    ("returns_string", "reward function returns_string returned 'high' (a str) at index 0"),
])
def test_broken_reward_functions(func, needle, tiny, prompts_file, tmp_path):
    proc = run_rloo("--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--reward_funcs",
                    f"{REWARDS}:{func}", "--num_sample_generations", 0, "--output_dir", tmp_path / "out", cwd=tmp_path)
    check_one_line_error(proc, needle)
    assert not os.path.exists(tmp_path / "out")  # nothing was written as a "trained" model


def test_output_dir_with_a_trained_model_is_not_overwritten(tiny, prompts_file, tmp_path):
    out = tmp_path / "trained"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    proc = run_rloo("--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--output_dir", out,
                    cwd=tmp_path)
    check_one_line_error(proc, f"--output_dir {out} already holds a trained model")
    assert (out / "config.json").read_text() == '{"mine": true}'
    assert not os.path.exists(tmp_path / "runs")  # refused before any run folder was made
