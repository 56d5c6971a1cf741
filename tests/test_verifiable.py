"""Verifiable rewards (rloo_utils/verifiable.py) on hand-made completions, the arithmetic task's files and generator,
benchmark/gsm8k_data.py on local files in GSM8K's schema, and the GSM8K recipe's commands."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, check_one_line_error, run_env, run_rloo, write_jsonl
from rloo_utils.rewards import BUILTIN_REWARD_FUNCS, load_reward_func
from rloo_utils.verifiable import REWARD_FUNCS, answer_accuracy, gsm8k_accuracy, number_only
from rloo_utils import checks, options

ARITHMETIC = os.path.join(ROOT, "data", "arithmetic")


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("12", 12, 1.0),
        ("The answer is 12.", 12, 1.0),  # the right number inside a longer text, a trailing period
        ("7 + 5 = 12", 12, 1.0),  # several numbers: the last one is the answer
        ("12, or maybe 13", 12, 0.0),
        ("3 - 8 = -5", -5, 1.0),  # a negative
        ("\u22125", -5, 1.0),  # a Unicode minus
        ("8-3=5", 5, 1.0),  # a hyphen between numbers is not a sign
        ("8-3", -3, 0.0),
        ("It costs $1,234.", 1234, 1.0),  # a thousands comma
        ("1,2,3", 3, 1.0),  # commas not grouped in threes: three numbers
        ("12.0", 12, 1.0),  # numbers compare as numbers
        ("12.5", 12, 0.0),
        ("2.50", "2.5", 1.0),
        ("", 12, 0.0),  # an empty completion
        ("no number here", 0, 0.0),
        ("so 5 + 7 = 12 #### 12 and then 13", 12, 1.0),  # "####" marks the answer
        ("#### 1,000", "#### 1000", 1.0),  # a GSM8K solution as the answer
        ("3/4", "0.75", 1.0),  # a fraction, whole
        ("4", "3/4", 0.0),  # an answer is read whole: 3/4 is not 4
        ("0.1", 0.1, 1.0),  # a float column: 0.1 is 1/10, not its binary neighbour
        ("7 + 5 is...12", 12, 1.0),
        (".5", 0.5, 1.0),
        ('The final answer after "####" is 18', 18, 1.0),  # "####" without a number: the last number
        ("#### 1,8", 18, 0.0),  # commas after "####" read as everywhere
        ("12", None, None),  # a row without an answer is not scored
        ("12", "", None),
        ("12", float("nan"), None),
    ],
)
def test_answer_accuracy(completion, answer, expected):
    assert answer_accuracy([completion], [answer]) == [expected]
    assert answer_accuracy([chat(completion)], [answer]) == [expected]  # conversational: the assistant's message


@pytest.mark.parametrize("func", [answer_accuracy, gsm8k_accuracy])
def test_an_answer_without_a_number_is_a_mistake_named_not_a_row_skipped(func):
    for answer in ["twelve", "#### twelve", True, float("inf")]:
        with pytest.raises(ValueError, match="holds no number to compare with"):
            func(["12"], [answer])


def test_gsm8k_accuracy_reads_only_the_marked_answer():
    completions = ["so 72 #### 72", "the answer is 72", "#### 7", "#### $72.", "#### -3", "####", "#### 72\n#### 71"]
    assert gsm8k_accuracy(completions, [72, 72, 72, 72, "#### -3", 72, 72]) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert gsm8k_accuracy(["#### 72"], [None]) == [None]


def test_number_only_is_the_format_right_or_wrong():
    completions = ["12", " 12. ", "-5", "1,000", "The answer is 12.", "12 apples", "", "12 13"]
    assert number_only(completions, [12] * 8) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert number_only(["12", "12"], [None, "  "]) == [None, None]
    assert number_only(["12"], ["Paris"]) == [1.0]  # another task's answer: the format is still read
    assert number_only(["12", "twelve"]) == [1.0, 0.0]  # without an answer column: the format alone


def test_every_script_offers_them_by_name_and_as_a_file():
    """The scripts' built-in reward functions (set_up.plan_run loads --reward_funcs from them) hold these by name."""
    builtin = BUILTIN_REWARD_FUNCS
    for name, func in REWARD_FUNCS.items():
        assert load_reward_func(name, builtin) is func
    from_file = load_reward_func(os.path.join(ROOT, "rloo_utils", "verifiable.py") + ":answer_accuracy", builtin)
    assert from_file(["7 + 5 = 12"], [12]) == [1.0]


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_the_arithmetic_files_are_what_their_script_writes(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ARITHMETIC, "make.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    for split in ("train", "test"):
        assert (tmp_path / f"{split}.jsonl").read_text() == open(os.path.join(ARITHMETIC, f"{split}.jsonl")).read()
    (tmp_path / "test.jsonl").write_text("mine\n")  # someone's file: never overwritten
    again = subprocess.run(
        [sys.executable, os.path.join(ARITHMETIC, "make.py"), "--out", str(tmp_path), "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode != 0 and again.stderr.count("\n") == 1 and "nothing is overwritten" in again.stderr
    assert (tmp_path / "test.jsonl").read_text() == "mine\n"
    train, test = (
        read_jsonl(os.path.join(ARITHMETIC, "train.jsonl")),
        read_jsonl(os.path.join(ARITHMETIC, "test.jsonl")),
    )
    assert len(train) == 240 and len(test) == 60
    questions = [row["prompt"][0]["content"] for row in train + test]
    assert len(set(questions)) == 300  # every problem once, none in both splits
    assert {s: sum(r["data_source"] == s for r in test) for s in ("add", "subtract", "multiply")} == {
        "add": 20,
        "subtract": 20,
        "multiply": 20,
    }
    for row, question in zip(train + test, questions):  # each answer is right
        a, symbol, b = question.removeprefix("What is ").split("?")[0].split()
        assert row["answer"] == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[symbol]
        assert answer_accuracy([str(row["answer"])], [row["answer"]]) == [1.0]


def gsm8k_source(folder, rows: list[dict]) -> str:
    os.makedirs(folder, exist_ok=True)
    for split in ("train", "test"):
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(folder)


def gsm8k_data(*args) -> subprocess.CompletedProcess:
    command = [sys.executable, os.path.join(ROOT, "benchmark", "gsm8k_data.py"), *map(str, args)]
    return subprocess.run(
        command, capture_output=True, text=True, env={**run_env(), "HF_HUB_OFFLINE": "1"}, timeout=600
    )


@pytest.mark.slow
def test_gsm8k_data_writes_prompts_and_answers(tmp_path):
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
        {"question": "It costs $1,200 less $50.", "answer": "1200-50=1150\n#### 1,150"},
    ]
    source, out = gsm8k_source(tmp_path / "source", rows), tmp_path / "out"
    proc = gsm8k_data("--source", source, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["test.jsonl", "train.jsonl"]  # nothing written aside is left
    written = read_jsonl(out / "test.jsonl")
    assert [r["answer"] for r in written] == [7, 1150] and {r["data_source"] for r in written} == {"gsm8k"}
    assert written[0]["prompt"] == [
        {
            "role": "user",
            "content": rows[0]["question"] + ' Let\'s think step by step and output the final answer after "####".',
        }
    ]
    assert gsm8k_accuracy(["... #### 1,150"], [written[1]["answer"]]) == [1.0]
    again = gsm8k_data("--source", source, "--out", out)  # never overwrites
    assert again.returncode != 0 and again.stderr.count("\n") == 1 and "already holds train.jsonl" in again.stderr


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"question": "q", "answer": "no final answer"}], "has no '#### <number>'"),
        ([{"text": "q", "answer": "#### 1"}], "has no column 'question'"),
    ],
)
@pytest.mark.slow
def test_gsm8k_data_refuses_in_one_line(tmp_path, rows, message):
    proc = gsm8k_data("--source", gsm8k_source(tmp_path / "source", rows), "--out", tmp_path / "out")
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and message in proc.stderr
    assert not (tmp_path / "out").exists()
    offline = gsm8k_data("--out", tmp_path / "out")  # the hub id, with no hub
    assert (
        offline.returncode != 0 and offline.stderr.count("\n") == 1 and "could not load openai/gsm8k" in offline.stderr
    )


@pytest.mark.parametrize(
    "text, message",
    [("", "test.jsonl is empty"), ('{"question": "q", "ans\n', "could not read"), ("\n", "could not read")],
)
@pytest.mark.slow
def test_gsm8k_data_says_an_empty_or_broken_file_in_one_line(tmp_path, text, message):
    source = gsm8k_source(tmp_path / "source", [{"question": "q", "answer": "#### 1"}])
    with open(os.path.join(source, "test.jsonl"), "w") as f:
        f.write(text)
    proc = gsm8k_data("--source", source, "--out", tmp_path / "out")
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_gsm8k_recipe_runs_commands_its_script_accepts(tmp_path, monkeypatch):
    """benchmark/experiments/gsm8k.sh (--dry_run, its data already prepared): rloo_vllm.py accepts every option, the
    published run's batch (256 prompts, 4 minibatches) and 435 updates; EXTRA's options come last and win."""
    data = gsm8k_source(tmp_path / "data", [{"prompt": "q", "answer": 1}])
    env = {**run_env(), "DATA": data, "SEEDS": "2", "EXTRA": "--total_episodes 2048"}
    recipe = os.path.join(ROOT, "benchmark", "experiments", "gsm8k.sh")
    proc = subprocess.run(["bash", recipe, "--dry_run"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line) for line in proc.stdout.splitlines() if line.startswith("python rloo")]
    assert [(c[1], c[-1]) for c in commands] == [("rloo_vllm.py", "1"), ("rloo_vllm.py", "2")]
    import rloo_vllm

    monkeypatch.setattr(sys, "argv", commands[0][1:])
    args = options.parse_args(rloo_vllm.Args)
    checks.check_args(args)
    assert (args.model_name_or_path, args.reward_funcs, args.dataset_name) == (
        "Qwen/Qwen2.5-0.5B-Instruct",
        ["gsm8k_accuracy"],
        data,
    )
    rollout = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    assert rollout // args.num_generations == 256 and args.num_mini_batches == 4 and args.total_episodes == 2048
    monkeypatch.setattr(sys, "argv", [*commands[0][1:-4], "--seed", "1"])  # without EXTRA: the published length
    args = options.parse_args(rloo_vllm.Args)
    assert args.total_episodes // rollout == 435


@pytest.mark.slow
def test_a_reward_function_whose_column_the_dataset_lacks_is_refused_before_the_models_load(tiny, tmp_path):
    data = tmp_path / "data"
    write_jsonl(str(data / "train.jsonl"), [{"prompt": "1 + 1 =", "answer": 2}] * 4)
    write_jsonl(str(data / "test.jsonl"), [{"prompt": "2 + 2 ="}] * 2)  # the held-out split has no answer
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--reward_funcs",
        "answer_accuracy",
        cwd=tmp_path,
    )
    check_one_line_error(proc, "reward function answer_accuracy needs the argument 'answer'", "held-out split")
    assert not (tmp_path / "runs").exists()  # nothing started


def test_check_reward_columns():
    from datasets import Dataset

    from rloo_utils.errors import UsageError
    from rloo_utils.rewards import check_reward_columns

    train, test = Dataset.from_list([{"prompt": "p", "answer": 1}]), Dataset.from_list([{"prompt": "p", "topic": "a"}])
    run = dict(num_sample_generations=10, eval_steps=0.5, multi_turn=False)
    no_held_out = dict(num_sample_generations=0, eval_steps=0, multi_turn=False)
    multi_turn = dict(num_sample_generations=0, eval_steps=0, multi_turn=True)  # --tools or --environment

    def needs_topic(completions, topic, **kwargs): ...

    def any_column(**kwargs): ...

    def needs_environments(completions, environments, **kwargs): ...

    check_reward_columns([answer_accuracy, any_column], ["model", "answer_accuracy", "any"], [], [], train, None, **run)
    check_reward_columns([any_column], ["any"], [needs_topic], ["needs_topic"], train, test, **run)  # metric: held-out
    check_reward_columns([answer_accuracy], ["answer_accuracy"], [], [], train, test, **no_held_out)  # test never read
    check_reward_columns([needs_environments], ["e"], [], [], train, None, **multi_turn)
    with pytest.raises(UsageError, match="reward function needs_topic needs the argument 'topic'.*training split"):
        check_reward_columns([needs_topic], ["needs_topic"], [], [], train, test, **run)
    with pytest.raises(UsageError, match="reward function answer_accuracy needs the argument 'answer'.*held-out"):
        check_reward_columns([answer_accuracy], ["answer_accuracy"], [], [], train, test, **run)
    with pytest.raises(UsageError, match="evaluation metric function answer_accuracy needs the argument 'answer'"):
        check_reward_columns([], [], [answer_accuracy], ["answer_accuracy"], train, test, **run)
    with pytest.raises(UsageError, match="needs the argument 'environments'"):  # single-turn: none given
        check_reward_columns([needs_environments], ["e"], [], [], train, None, **run)


# ---------------------------------------------------------------------------------------------------------------------
# DAPO's soft overlong punishment (issue 57): a built-in reward function whose lengths come from the options
# ---------------------------------------------------------------------------------------------------------------------
def test_the_soft_overlong_punishment_by_hand():
    from rloo_utils.rewards import builtin_reward_funcs, soft_overlong_punishment

    ids = [[1] * n for n in (0, 3, 6, 7, 8, 10)]  # the buffer is the last 4 of 10 tokens: it starts after 6
    assert soft_overlong_punishment(ids, max_completion_length=10, buffer_length=4) == [0, 0, 0, -0.25, -0.5, -1.0]
    assert soft_overlong_punishment(ids[-1:], max_completion_length=10, buffer_length=4, penalty_factor=2.0) == [-2.0]
    # as --reward_funcs soft_overlong_punishment gets it: --max_completion_length, the buffer (a fifth of it unless
    # given), the factor; in TRL's signature, completion_ids among its arguments
    builtin = builtin_reward_funcs(max_completion_length=10, overlong_buffer_length=None, overlong_penalty_factor=1.0)
    overlong = load_reward_func("soft_overlong_punishment", builtin)
    assert overlong(prompts=["p"] * 6, completions=["c"] * 6, completion_ids=ids) == [0, 0, 0, 0, 0, -1.0]
    builtin = builtin_reward_funcs(max_completion_length=10, overlong_buffer_length=4, overlong_penalty_factor=0.5)
    overlong = load_reward_func("soft_overlong_punishment", builtin)
    assert overlong(completion_ids=ids) == [0, 0, 0, -0.125, -0.25, -0.5]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--overlong_buffer_length", "4"], "is for the reward function soft_overlong_punishment"),
        (["--overlong_penalty_factor", "2"], "is for the reward function soft_overlong_punishment"),
        (["--reward_funcs", "soft_overlong_punishment", "--soft_punish_cache", "40"], "must be in [1, "),
        (["--reward_funcs", "soft_overlong_punishment", "--overlong_buffer_length", "0"], "must be in [1, "),
        (["--reward_funcs", "soft_overlong_punishment", "--overlong_penalty_factor", "-1"], "must be >= 0"),
    ],
)
def test_bad_overlong_options_are_refused_by_the_checks(argv, message):
    import tyro

    import rloo
    from rloo_utils.errors import UsageError

    args = tyro.cli(rloo.Args, args=[*argv, "--max_completion_length", "32"], use_underscores=True)
    with pytest.raises(UsageError, match=re.escape(message)):
        checks.check_args(args)


@pytest.mark.slow
def test_an_overlong_option_without_its_function_is_one_line_before_anything_starts(tmp_path):
    proc = run_rloo("--overlong_buffer_length", 4, cwd=tmp_path)
    check_one_line_error(proc, "--overlong_buffer_length 4 is for the reward function soft_overlong_punishment")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_run_punishes_its_truncated_completions_whole(tiny, tmp_path):
    """Every completion of a run that samples past EOS has --max_completion_length tokens: the punishment is the whole
    factor on each one, logged under its own name beside the other source's."""
    data = tmp_path / "data.jsonl"
    write_jsonl(str(data), [{"prompt": f"say {w}"} for w in ("a", "b", "c", "d")])
    proc = run_rloo(
        *("--model_name_or_path", tiny["policy"], "--dataset_name", data, "--total_episodes", 16),
        *("--reward_funcs", "completion_length", "soft_overlong_punishment", "--overlong_penalty_factor", 0.5),
        *("--ignore_eos", "--max_completion_length", 6, "--run_name", "run"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from conftest import read_metrics

    (row,) = read_metrics(tmp_path)
    assert row["rewards/soft_overlong_punishment/mean"] == -0.5 and row["rewards/completion_length/mean"] == 6
