"""Bad input: a one-line error naming the problem, a non-zero exit, no traceback, and nothing overwritten."""

import copy
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import tyro

from conftest import ROOT, check_one_line_error, keywords_of, read_metrics, run_env, run_rloo, write_jsonl

import rloo
from rloo_utils.data import load_datasets, load_prompt_dataset
from rloo_utils.errors import UsageError
from rloo_utils.models import check_reward_model_config, load_reward_tokenizer, load_tokenizers
from rloo_utils.checks import check_args
from rloo_utils.rewards import call_reward_funcs
from rloo_utils.vllm_options import check_vllm_args

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
    (["--reward_weights", 0], ["--reward_weights are all 0: no reward would reach the advantages"]),
    (["--reward_funcs", "no_such_reward"], ["unknown reward function 'no_such_reward'"]),
    (["--reward_funcs", f"{REWARDS}:no_such_function"], ["has no function 'no_such_function'"]),
    (["--reward_funcs", "/nowhere/rewards.py:f"], ["reward function file /nowhere/rewards.py does not exist"]),
    (["--reward_model_path", "/nowhere/rm"], ["--reward_model_path /nowhere/rm does not exist"]),
    (["--dataset_name", "/nowhere/data.jsonl"], ["--dataset_name /nowhere/data.jsonl does not exist"]),
    # The combinations seed 002 rules out, and the ones that contradict themselves
    (
        ["--advantage_estimator", "dr_grpo", "--advantage_normalization", "batch"],
        ["--advantage_estimator dr_grpo does not take batch normalisation"],
    ),
    (
        ["--advantage_estimator", "reinforce_pp", "--advantage_normalization", "group"],
        ["reinforce_pp needs batch normalisation", "got --advantage_normalization group"],
    ),
    (
        ["--advantage_estimator", "reinforce_pp", "--advantage_normalization", "none"],
        ["reinforce_pp needs batch normalisation"],
    ),
    (
        ["--advantage_estimator", "grpo", "--normalize_advantages", "--advantage_normalization", "group"],
        ["--normalize_advantages means --advantage_normalization batch"],
    ),
    # The options TRL users bring: each one that cannot work is named with its fix
    (
        ["--generation_kwargs", '{"temperature": 0.5}'],
        ["--generation_kwargs sets temperature, which --temperature sets"],
    ),
    (
        ["--generation_kwargs", '{"num_beams": 4}'],
        ["--generation_kwargs sets num_beams, which the rollout sets itself"],
    ),
    (
        ["--generation_kwargs", '{"no_repeat_ngrams": 2}'],
        ["no_repeat_ngrams is not an option of transformers' GenerationConfig"],
    ),
    (
        ["--generation_kwargs", '{"return_dict_in_generate": true}'],
        ["sets return_dict_in_generate, which the rollout sets"],
    ),
    (["--generation_kwargs", '{"stop_strings": ["."]}'], ["sets stop_strings, which works on text"]),
    (
        ["--lr_scheduler_type", "cosine_with_min_lr"],
        ["--lr_scheduler_type cosine_with_min_lr", "min_lr or min_lr_rate"],
    ),
    (
        ["--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}'],
        ["--lr_scheduler_type cosine with --lr_scheduler_kwargs", "min_lr_rate"],
    ),
    (["--warmup_steps", 2.5], ["--warmup_steps 2.5: give a number of steps (a whole number), or a fraction"]),
    (["--num_completions_to_print", 2], ["--num_completions_to_print limits the table of --log_completions"]),
    (["--min_p", 1.5], ["--min_p must be in [0, 1]"]),
    (["--repetition_penalty", 0], ["--repetition_penalty must be > 0"]),
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
    (["--ignore_eos", "--stop_token", "eos"], ["--ignore_eos samples past EOS and --stop_token eos stops at it"]),
    # Numbers that make no sense (the rest of the list is checked in-process below)
    (["--beta", "nan"], ["--beta must be a finite number, got nan"]),
    (["--seed", -1], ["--seed must be in [0, 2**32) (numpy's seed range), got -1"]),
    (
        ["--reward_funcs", "completion_length", f"{REWARDS}:completion_length"],
        ["two reward sources have the same name (completion_length, completion_length)"],
    ),
    # Checkpoints
    (["--save_steps", -1], ["--save_steps must be >= 0"]),
    (["--save_total_limit", 0], ["--save_total_limit must be >= 1"]),
    (["--max_skipped_steps", 0], ["--max_skipped_steps must be > 0"]),
    (["--resume_from_checkpoint", "latest"], ["--resume_from_checkpoint latest needs --run_name"]),
    (
        ["--resume_from_checkpoint", "/nowhere/checkpoint-3"],
        ["/nowhere/checkpoint-3 does not exist (--resume_from_checkpoint /nowhere/checkpoint-3)"],
    ),
    (
        ["--resume_from_checkpoint", "latest", "--run_name", "nothing_here"],
        ["runs/nothing_here does not exist (--resume_from_checkpoint latest --run_name nothing_here)"],
    ),
]


# The same checks in-process (check_args is what the script calls first): each would cost a process start
OPTIONS = [
    ({"beta": math.inf}, "--beta must be a finite number, got inf"),
    ({"reward_weights": [1.0, math.nan]}, "--reward_weights must be a finite number, got nan"),
    ({"missing_eos_penalty": math.nan}, "--missing_eos_penalty must be a finite number, got nan"),
    ({"temperature": math.inf}, "--temperature must be a finite number, got inf"),
    ({"learning_rate": math.inf}, "--learning_rate must be a finite number, got inf"),
    ({"weight_decay": math.nan}, "--weight_decay must be a finite number, got nan"),
    ({"reward_clip_range": [math.nan, 1.0]}, "--reward_clip_range must be a finite number, got nan"),
    ({"seed": 2**32}, "--seed must be in [0, 2**32) (numpy's seed range), got 4294967296"),
    ({"stop_token_id": -1}, "--stop_token_id must be a token id (>= 0), got -1"),
    ({"run_name": "a/b"}, "--run_name names a folder in runs/ and must be a plain name (no '/'), got 'a/b'"),
    ({"run_name": ".."}, "--run_name names a folder in runs/"),
    ({"exp_name": ""}, "--exp_name names a folder in runs/"),
    ({"output_dir": ""}, "--output_dir is empty"),
    ({"num_sample_prompts": 0}, "--num_sample_prompts 0 leaves the sample tables (--num_sample_generations 10) empty"),
    # Values that pass as numbers but not as what the run makes of them: past float32, or past what a schedule means
    ({"missing_eos_penalty": 1e39}, "--missing_eos_penalty 1e+39 is past the float32 range"),
    ({"reward_weights": [1.0, -2e200]}, "--reward_weights -2e+200 is past the float32 range"),
    ({"reward_timeout": 0.0}, "--reward_timeout must be > 0, got 0.0"),
    ({"temperature": 1e-300}, "--temperature 1e-300 is below the smallest normal float32"),  # 1/T: inf logits
    ({"learning_rate": 1e-40}, "--learning_rate 1e-40 is below the smallest normal float32"),  # steps of 0
    ({"generation_kwargs": {"max_time": 0.01}}, "--generation_kwargs sets max_time, which the rollout sets itself"),
    ({"generation_kwargs": {"min_length": 50}}, "--generation_kwargs sets min_length, which the rollout sets itself"),
    (
        {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 50}},
        "min_lr_rate is the floor as a fraction of --learning_rate, in [0, 1], got 50",
    ),
    (
        {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1.0}},
        "min_lr 1.0 is above --learning_rate 3e-05, so the schedule would climb to it",
    ),
    ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 0}}, "num_cycles 0 never decays the rate"),
    (
        {"warmup_steps": 4, "total_episodes": 64, "per_device_train_batch_size": 16},
        "--warmup_steps 4 is not shorter than the run (4 optimizer steps)",
    ),
    # --generation_kwargs values HF generate cannot use, tried before the policy loads
    ({"generation_kwargs": {"typical_p": "abc"}}, "HF generate cannot use it (TypeError: '<' not supported"),
    (
        {"generation_kwargs": {"cache_implementation": "static"}},
        "--generation_kwargs sets cache_implementation, which --cache_implementation sets: use that option",
    ),
    ({"generation_kwargs": {"sequence_bias": 5}}, "HF generate cannot use it (ValueError: `sequence_bias` has to be"),
    (
        {"chat_template_kwargs": {"add_generation_prompt": False, "tokenize": True}},
        "--chat_template_kwargs sets add_generation_prompt, tokenize, an argument of apply_chat_template",
    ),
]


@pytest.mark.parametrize("options,needle", OPTIONS, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(OPTIONS)])
def test_options_that_make_no_sense(options, needle):
    with pytest.raises(UsageError, match=re.escape(needle)):
        args = rloo.Args(**options)
        check_args(args)
        rloo.check_algorithm(args)


def test_generation_kwargs_values_that_generate_takes_are_accepted():
    check_args(rloo.Args(generation_kwargs={"typical_p": 0.9, "no_repeat_ngram_size": 3}))


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (
            {"presence_penalty": "x"},
            "vLLM's SamplingParams cannot use it (ValidationError: Expected `float`, got `str`",
        ),
        ({"frequency_penalty": 5}, "frequency_penalty must be in [-2, 2], got 5.0"),
    ],
)
def test_generation_kwargs_values_vllm_cannot_use_are_refused_before_loading(kwargs, needle):
    import rloo_vllm

    with pytest.raises(UsageError, match=re.escape(needle)):
        check_vllm_args(rloo_vllm.Args(generation_kwargs=kwargs), server=False)


def test_chat_template_kwargs_with_plain_string_prompts_are_refused(prompts_file):
    with pytest.raises(UsageError, match="--chat_template_kwargs goes to the chat template, but the"):
        args = rloo.Args(dataset_name=prompts_file, chat_template_kwargs={"enable_thinking": False})
        load_datasets(**keywords_of(load_datasets, args))


def test_infinite_values_that_mean_something_are_accepted():
    check_args(rloo.Args(max_grad_norm=math.inf, reward_clip_range=[-math.inf, 5.0]))  # no clipping; one-sided


THROUGH_THE_SCRIPT = [["--num_generations", 1], ["--beta", "nan"], ["--ppo_clip"], ["--save_steps", -1]]


# Checked after check_args, by the script (the reward sources, the checkpoint to resume): each through a run of it
CHECKED_LATER = ("--reward_weights", "--reward_funcs", "--resume_from_checkpoint")


@pytest.mark.parametrize(
    "extra,needles",
    [
        pytest.param(e, n, marks=[pytest.mark.slow] if e in THROUGH_THE_SCRIPT or e[0] in CHECKED_LATER else [])
        for e, n in EARLY
    ],
    ids=[" ".join(map(str, e)) for e, _ in EARLY],
)
def test_checked_before_models_load(extra, needles, prompts_file, tmp_path):
    argv = ["--model_name_or_path", str(tmp_path), "--dataset_name", prompts_file, *map(str, extra)]
    # check_args and check_algorithm are the first things the script does with its options: a refusal they make needs
    # no process of its own (each costs ~2 s of importing torch), except for a few that show the whole path is one line.
    if extra not in THROUGH_THE_SCRIPT:
        try:
            args = tyro.cli(rloo.Args, args=argv, use_underscores=True)
            check_args(args)  # the features' options
            rloo.check_algorithm(args)  # the estimator's and the loss's, beside their registries
        except UsageError as e:
            assert all(needle in str(e) for needle in needles), str(e)
            return
    # A policy path that would fail to load proves the check came first, unless the check is about that path.
    check_one_line_error(run_rloo(*argv, cwd=tmp_path), *needles)


@pytest.mark.slow
def test_missing_model_path(prompts_file, tmp_path):
    check_one_line_error(
        run_rloo("--model_name_or_path", "/nowhere/model", "--dataset_name", prompts_file, cwd=tmp_path),
        "--model_name_or_path /nowhere/model does not exist",
    )


@pytest.mark.slow
def test_folder_that_is_not_a_model(prompts_file, tmp_path):
    check_one_line_error(
        run_rloo("--model_name_or_path", tmp_path, "--dataset_name", prompts_file, cwd=tmp_path),
        "could not load",
        str(tmp_path),
    )


def refused_on_loading(*argv, needles: tuple[str, ...]) -> None:
    """The script's first loads (the data, then the tokenizers) from its command line refuse it with a UsageError that
    says every needle: what the script prints as one line (test_folder_that_is_not_a_model holds that path)."""
    args = tyro.cli(rloo.Args, args=list(map(str, argv)), use_underscores=True)
    with pytest.raises(UsageError) as refusal:
        train, _ = load_datasets(**keywords_of(load_datasets, args))
        load_tokenizers(train[0]["prompt"], **keywords_of(load_tokenizers, args))
    assert all(needle in str(refusal.value) for needle in needles), str(refusal.value)


def test_dataset_without_prompt_column(tiny, tmp_path):
    data = write_jsonl(str(tmp_path / "d.jsonl"), [{"question": "x"}])
    refused_on_loading(
        "--model_name_or_path", tiny["policy"], "--dataset_name", data, needles=("has no 'prompt' column", "question")
    )


def test_empty_dataset(tiny, tmp_path):
    data = tmp_path / "empty.csv"
    data.write_text("prompt\n")
    refused_on_loading("--model_name_or_path", tiny["policy"], "--dataset_name", data, needles=("is empty",))


def test_missing_split(tiny, prompts_file):
    data = os.path.dirname(prompts_file)
    argv = ["--model_name_or_path", tiny["policy"], "--dataset_name", data, "--dataset_train_split", "nope"]
    refused_on_loading(*argv, needles=("has no split 'nope'",))


@pytest.mark.parametrize(
    "func,needle",
    [
        ("raises", "reward function raises raised RuntimeError: the judge is down"),
        ("wrong_count", "reward function wrong_count must return a list of 16 floats (or None), got 15 values"),
        ("returns_nan", "reward function returns_nan returned nan at index 0; return None"),
        ("returns_string", "reward function returns_string returned 'high' (a str) at index 0"),
    ],
)
@pytest.mark.slow
def test_broken_reward_functions(func, needle, tiny, prompts_file, tmp_path):
    import reward_fixtures

    if func != "raises":  # in-process: the script's path to a one-line error is the same for all four
        with pytest.raises(UsageError, match=re.escape(needle)):
            call_reward_funcs(
                [getattr(reward_fixtures, func)], [func], 16, None, completions=["x"] * 16, prompts=["p"] * 16
            )
        return
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--reward_funcs",
        f"{REWARDS}:{func}",
        "--num_sample_generations",
        0,
        "--output_dir",
        tmp_path / "out",
        cwd=tmp_path,
    )
    check_one_line_error(proc, needle)
    assert not os.path.exists(tmp_path / "out")  # nothing was written as a "trained" model


@pytest.mark.slow
def test_output_dir_with_a_trained_model_is_not_overwritten(tiny, prompts_file, tmp_path):
    out = tmp_path / "trained"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    proc = run_rloo(
        "--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--output_dir", out, cwd=tmp_path
    )
    check_one_line_error(proc, f"--output_dir {out} is not empty: it holds config.json")
    assert (out / "config.json").read_text() == '{"mine": true}' and os.listdir(out) == ["config.json"]
    assert os.listdir(tmp_path / "runs") == []  # the run folder it had claimed is gone again


# ------------------------------------------------------------------------------------------------------------------
# Data: checked before any folder is made or any model loads (the model path given is not a model)
# ------------------------------------------------------------------------------------------------------------------
DATA = [
    ([{"prompt": 3}], "prompt 0 is 3; a prompt must be a non-empty string or a list of chat messages"),
    ([{"prompt": None}], "prompt 0 is None; a prompt must be"),
    ([{"prompt": ""}], "prompt 0 is ''; a prompt must be"),
    ([{"prompt": ["a", "b"]}], "prompt 0 is ['a', 'b']; a prompt must be"),
    ([{"prompt": {"text": "a"}}], "prompt 0 is {'text': 'a'}; a prompt must be"),
    ([{"prompt": [{"role": "user"}]}], "prompt 0 is [{'role': 'user'}]; a prompt must be"),
    (
        [{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}],
        "prompt 1 is [{'role': 'user', 'content': 'b'}], but the prompts must each be a non-empty string (as prompt 0 is)",
    ),
    (
        [{"prompt": [{"role": "user", "content": "b"}]}, {"prompt": [{"role": "user", "content": None}]}],
        "prompt 1 is [{'role': 'user', 'content': None}], but the prompts must each be a list of chat messages",
    ),
    (
        [{"prompt": "a", "completions": "x"}],
        "has a column 'completions', the name of an argument every reward function gets",
    ),
    ([{"prompt": "a", "prompts": "x"}], "has a column 'prompts'"),
    ([{"prompt": "a", "completion_ids": [1]}], "has a column 'completion_ids'"),
]


@pytest.mark.parametrize("rows,needle", DATA, ids=[str(i) for i in range(len(DATA))])
def test_bad_prompts_and_columns(rows, needle, tmp_path):
    data = write_jsonl(str(tmp_path / "d.jsonl"), rows)
    with pytest.raises(UsageError, match=re.escape(needle)):
        load_prompt_dataset(data, "train")


@pytest.mark.slow
def test_bad_prompts_are_one_line_before_anything_is_made(tmp_path):
    data = write_jsonl(str(tmp_path / "d.jsonl"), [{"prompt": "a"}, {"prompt": 3}])
    check_one_line_error(
        run_rloo("--model_name_or_path", tmp_path, "--dataset_name", data, cwd=tmp_path),
        "prompt 1 is 3, but the prompts must each be a non-empty string",
    )
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize(
    "files,needle",
    [
        ({"train.jsonl": b""}, "data file {d}/train.jsonl is empty"),
        (
            {"train.jsonl": b'\xff\xfe{"prompt": "x"}\n'},
            "data file {d}/train.jsonl is not UTF-8 text (invalid start byte)",
        ),
        (
            {"train.jsonl": b'{"prompt": "caf\xe9"}\n'},
            "data file {d}/train.jsonl is not UTF-8 text (invalid continuation byte)",
        ),
        (
            {"train.jsonl": b'{"prompt": "x"\n'},
            "dataset {d} (split train) is empty or unreadable (ArrowInvalid: JSON parse error",
        ),
        (
            {"train.jsonl": b'{"prompt": "a"}\n', "train.csv": b"prompt\nb\n"},
            "split train of {d} mixes file formats (train.csv, train.jsonl): keep one format per split",
        ),
        (
            {"train.jsonl": b'{"prompt": "a"}\n', "test.jsonl": b'{"prompt": [{"role": "user", "content": "b"}]}\n'},
            "the prompts of split test and of split train are not of one kind",
        ),
    ],
)
def test_bad_data_files(files, needle, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content)
    with pytest.raises(UsageError, match=re.escape(needle.format(d=folder))):
        load_datasets(**keywords_of(load_datasets, rloo.Args(dataset_name=str(folder))))


@pytest.mark.slow
def test_a_file_datasets_cannot_parse_is_one_line(tmp_path):
    """datasets logs its own error line too; only rloo.py's may reach the user."""
    (tmp_path / "d.jsonl").write_text('{"prompt": "x"\n')
    check_one_line_error(
        run_rloo("--model_name_or_path", tmp_path, "--dataset_name", tmp_path / "d.jsonl", cwd=tmp_path),
        "(ArrowInvalid: JSON parse error",
    )


@pytest.mark.slow
def test_formats_may_differ_between_splits_and_home_is_expanded(tiny, tmp_path):
    """train.jsonl with test.csv is fine (each split in its own format); ~ in paths is the user's home."""
    home = tmp_path / "home"
    write_jsonl(str(home / "data" / "train.jsonl"), [{"prompt": "the film was good"}] * 8)
    (home / "data" / "test.csv").write_text("prompt\nthe plot was\n")
    shutil.copytree(tiny["policy"], home / "policy")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "rloo.py"),
            "--model_name_or_path",
            "~/policy",
            "--dataset_name",
            "~/data",
            "--output_dir",
            "~/out",
            "--total_episodes",
            "16",
            "--max_completion_length",
            "4",
            "--num_sample_generations",
            "1",
            "--max_grad_norm",
            "inf",
        ],
        cwd=tmp_path,
        env={**run_env(), "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.exists(home / "out" / "config.json")  # --output_dir ~/out went to the home folder
    assert "the plot was" in open(glob.glob(str(tmp_path / "runs" / "*" / "samples.jsonl"))[0]).read()


# ------------------------------------------------------------------------------------------------------------------
# Tokenizers and reward models: checked from the tokenizer and the config, before any weights load
# ------------------------------------------------------------------------------------------------------------------
def copy_policy(tiny, folder, **tokenizer_changes):
    shutil.copytree(tiny["policy"], folder)
    tokenizer = copy.deepcopy(tiny["tokenizer"])
    for name, value in tokenizer_changes.items():
        setattr(tokenizer, name, value)
    tokenizer.save_pretrained(folder)
    return folder


def test_chat_prompts_need_a_chat_template(tiny, tmp_path):
    policy = copy_policy(tiny, tmp_path / "policy", chat_template=None)
    os.remove(policy / "chat_template.jinja")
    data = write_jsonl(str(tmp_path / "chat.jsonl"), [{"prompt": [{"role": "user", "content": "hi"}]}] * 8)
    needle = f"the prompts are chat messages, but the tokenizer of {policy} has no chat template"
    refused_on_loading("--model_name_or_path", policy, "--dataset_name", data, needles=(needle,))


def test_a_tokenizer_without_eos_is_refused(tiny, prompts_file, tmp_path):
    policy = copy_policy(tiny, tmp_path / "policy", eos_token=None)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(policy).eos_token_id is None
    needle = f"the tokenizer of {policy} has no EOS token"
    refused_on_loading("--model_name_or_path", policy, "--dataset_name", prompts_file, needles=(needle,))


def test_stop_token_id_outside_the_vocabulary(tiny, prompts_file):
    argv = ["--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--stop_token_id", 100000]
    needle = f"--stop_token_id 100000 is not in the vocabulary of {tiny['policy']} (400 tokens)"
    refused_on_loading(*argv, needles=(needle,))


def save_classifier(tiny, folder, **config):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tiny["policy"], **config))
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_reward_models_that_cannot_score(tiny, prompts_file, tmp_path):
    run = lambda rm: run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,  # noqa: E731
        "--reward_model_path",
        rm,
        cwd=tmp_path,
    )
    check_one_line_error(
        run(tiny["policy"]), f"--reward_model_path {tiny['policy']} is a LlamaForCausalLM, not a reward model"
    )
    # The config checks in-process (the same function the script calls before any weights load)
    two_labels = save_classifier(tiny, tmp_path / "two_labels", num_labels=2)
    with pytest.raises(UsageError, match=f"--reward_model_path {two_labels} has 2 labels; a reward model has one"):
        check_reward_model_config(str(two_labels), tiny["tokenizer"], False)
    small = save_classifier(tiny, tmp_path / "small_vocab", num_labels=1, vocab_size=100)
    assert (
        load_reward_tokenizer(str(small), tiny["tokenizer"], False) is None
    )  # no tokenizer: it reads the policy's ids
    with pytest.raises(
        UsageError,
        match=re.escape(
            f"--reward_model_path {small} knows 100 token ids, but the policy's "
            "tokenizer (it has none of its own, so it reads those ids) has 400"
        ),
    ):
        check_reward_model_config(str(small), tiny["tokenizer"], False)
    with pytest.raises(UsageError, match="but its own tokenizer has 400"):
        check_reward_model_config(str(small), tiny["tokenizer"], True)
    # A config that names no architecture (as a GGUF file's), over weights that have no score head (a causal LM's)
    headless = tmp_path / "headless"
    shutil.copytree(tiny["policy"], headless)
    config = json.load(open(headless / "config.json"))
    json.dump({k: v for k, v in config.items() if k != "architectures"}, open(headless / "config.json", "w"))
    check_one_line_error(
        run(headless), f"--reward_model_path {headless} has no trained score head (score.weight missing"
    )
    assert os.listdir(tmp_path / "runs") == []


# ------------------------------------------------------------------------------------------------------------------
# Reward functions
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "returned,needle",
    [
        ({i: 1.0 for i in range(2)}, "must return a list of 2 floats (or None), got a dict"),
        ("ab", "must return a list of 2 floats (or None), got a str"),
        ([10**400, 1.0], "returned an int too large for a float at index 0"),
        ([1.0, True], "returned True (a bool) at index 1"),
        (
            [1.0, 1e39],
            "returned 1e+39 at index 1, past the float32 range of the rewards",
        ),  # finite in float64, inf in 32
        ([2.0**200, 1.0], "returned 1.61e+60 at index 0, past the float32 range"),
    ],
)
def test_reward_function_results_that_are_refused(returned, needle):
    with pytest.raises(UsageError, match=re.escape(f"reward function f {needle}")):
        call_reward_funcs([lambda **kwargs: returned], ["f"], 2, None, completions=["a", "b"])[0]


def test_arrays_and_tensors_are_lists_of_floats():
    assert call_reward_funcs([lambda **kwargs: np.array([1, 2])], ["f"], 2, None)[0].tolist() == [1.0, 2.0]
    assert call_reward_funcs([lambda **kwargs: torch.tensor([0.5, -1.0])], ["f"], 2, None)[0].tolist() == [0.5, -1.0]


@pytest.mark.slow
def test_a_reward_function_cannot_end_the_run_quietly(tiny, prompts_file, tmp_path):
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--reward_funcs",
        f"{REWARDS}:calls_sys_exit",
        "--num_sample_generations",
        0,
        cwd=tmp_path,
    )
    check_one_line_error(proc, "reward function calls_sys_exit called sys.exit(3)")
    assert proc.returncode == 1


@pytest.mark.slow
def test_a_reward_module_that_exits_on_import(tmp_path, prompts_file):
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\ndef f(completions, **kwargs):\n    return []\n")
    proc = run_rloo(
        "--model_name_or_path",
        tmp_path,
        "--dataset_name",
        prompts_file,
        "--reward_funcs",
        f"{tmp_path}/exits.py:f",
        cwd=tmp_path,
    )
    check_one_line_error(proc, f"could not import reward function '{tmp_path}/exits.py:f' (SystemExit: 0)")


@pytest.mark.slow
def test_callable_instances_and_partials_are_reward_functions(tiny, prompts_file, tmp_path):
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--reward_funcs",
        f"{REWARDS}:length_reward",
        f"{REWARDS}:half_count_good",
        "--total_episodes",
        16,
        "--max_completion_length",
        4,
        "--num_sample_generations",
        0,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = read_metrics(tmp_path)[-1]
    assert row["rewards/length_reward/mean"] > 0 and "rewards/half_count_good/mean" in row


# ------------------------------------------------------------------------------------------------------------------
# tyro's parse errors, folded into one line
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--beta", "abc"], "Error parsing --kl_coef/--beta: could not convert string to float: 'abc'"),
        (["--no_such_flag", "1"], "Unrecognized options: --no_such_flag, 1"),
        (["--loss_type", "nope"], "invalid choice 'nope' for argument '--loss_type'"),
        # JSON accepts no NaN or Infinity (Python's json does), and 1e400 would parse as inf: refused as they parse
        (["--lr_scheduler_kwargs", '{"min_lr_rate": Infinity}'], "Infinity is not a JSON number: give a finite number"),
        (["--generation_kwargs", '{"typical_p": 1e400}'], "1e400 is past the range of a float: give a finite number"),
        (["--lr_scheduler_kwargs", '{"min_lr": 1' + "0" * 400 + "}"], "(401 digits) is past the range of a float"),
    ],
)
@pytest.mark.slow
def test_parse_errors_are_one_line(argv, needle, tmp_path):
    proc = run_rloo(*argv, cwd=tmp_path)
    line = check_one_line_error(proc, needle, "--help` lists them")
    assert proc.returncode == 2
    assert proc.stderr.strip() == line and not set("│╭╰─") & set(proc.stderr)


@pytest.mark.slow
def test_help_is_still_tyros(tmp_path):
    proc = run_rloo("--help", cwd=tmp_path)
    assert proc.returncode == 0 and "--beta" in proc.stdout and "KL coefficient" in proc.stdout
