"""A TRL user switches without friction: TRL's options (model loading, sampling, schedules, advantage normalisation,
completion tables), reward functions written for TRL 1.16 run unchanged, and docs/options.md maps every RLOOConfig field."""

import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import rloo
from rloo_utils.checkpoints import check_resumable
from rloo_utils.errors import RunError, UsageError
from rloo_utils.logs import Logger
from rloo_utils.generation import generation_configs, tokenize_prompts
from rloo_utils.options import resumable_options
from rloo_utils.checks import check_args
from rloo_utils.rewards import call_reward_funcs
from rloo_utils.scoring import RewardLogs, reward_model_inputs
from rloo_utils.vllm_options import check_vllm_args
from rloo_utils.vllm_sampling import sampling_options
import rloo_vllm
from conftest import ROOT, check_one_line_error, keywords_of, run_env, run_rloo
from test_multigpu import run_torchrun

TRL_REWARDS = os.path.join(ROOT, "tests", "trl_rewards.py")
REWARD_FUNCS = [f"{TRL_REWARDS}:{name}" for name in ("curriculum_reward", "the_reward", "async_length_reward")]


def run_dir_of(root) -> str:
    (run,) = glob.glob(os.path.join(root, "runs", "*", "metrics.jsonl"))
    return os.path.dirname(run)


def logger_in(folder, resume=None) -> Logger:
    """The Logger of a run of rloo.py's default options, writing to folder."""
    args = rloo.Args()
    return Logger("run", str(folder), resume, **keywords_of(Logger, args, options=dataclasses.asdict(args)))


def jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "rloo_multigpu.py", "rloo_vllm.py"])
def test_reward_functions_written_for_trl_run_unchanged(script, tiny, tmp_path):
    """TRL's keyword arguments (trainer_state, log_extra, log_metric; an async function awaited), on the embedded
    dataset (chat prompts; its default name is relative, so the same on every machine), with the sampled completions
    logged with their rewards and advantages; on 2 processes the table and the metrics hold every process's rows."""
    updates, prompts_per_update, G, steps_per_update = 3, 4, 4, 4
    options = [
        "--model_name_or_path",
        tiny["policy"],
        "--reward_funcs",
        *REWARD_FUNCS,
        "--num_generations",
        G,
        "--per_device_train_batch_size",
        8,
        "--num_mini_batches",
        2,
        "--num_ppo_epochs",
        2,
        "--total_episodes",
        updates * prompts_per_update * G,
        "--max_completion_length",
        8,
        "--log_completions",
        "--num_completions_to_print",
        2,
        "--num_sample_generations",
        1,
        "--min_p",
        0.02,
        "--repetition_penalty",
        1.2,
        "--run_name",
        "trl",
    ]
    if script == "rloo_multigpu.py":  # 2 processes of 8 rows each
        proc = run_torchrun(2, *options, "--per_device_train_batch_size", 4, cwd=tmp_path)
    else:
        proc = run_rloo(*options, cwd=tmp_path, script=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = run_dir_of(tmp_path)
    with open(os.path.join(run_dir, "args.json")) as f:
        assert json.load(f)["dataset_name"] == "data/movie_reviews"  # openrlbenchmark's env id: no path of this machine
    num_train_prompts = len(jsonl(os.path.join(ROOT, "data", "movie_reviews", "train.jsonl")))
    metrics = [row for row in jsonl(os.path.join(run_dir, "metrics.jsonl")) if "episode" in row]  # (not evaluations)
    rows = jsonl(os.path.join(run_dir, "completions.jsonl"))
    assert len(metrics) == updates and len(rows) == updates * prompts_per_update * G
    for update, row in enumerate(metrics, 1):
        # trainer_state as the reward functions saw it, before the update's optimizer steps
        assert row["log_metric/trainer_state/global_step"] == (update - 1) * steps_per_update
        assert row["log_metric/trainer_state/max_steps"] == updates * steps_per_update
        epoch = (update - 1) * prompts_per_update / num_train_prompts
        assert row["log_metric/trainer_state/epoch"] == pytest.approx(epoch)
        assert row["global_step"] == update * steps_per_update  # TRL 1.x's x-axis: optimizer steps done
        assert row["log_metric/async/same_loop_as_first_call"] == 1.0
        # rank 0's only (the mean over 2 processes is 1/2), as TRL gives it
        assert row["log_metric/trainer_state/is_world_process_zero"] == (0.5 if script == "rloo_multigpu.py" else 1.0)
        table = [r for r in rows if r["step"] == row["episode"]]
        assert len(table) == prompts_per_update * G
        assert set(table[0]) == {
            "step",
            "prompt",
            "completion",
            "curriculum_reward",
            "the_reward",
            "async_length_reward",
            "advantage",
            "says_the",
            "completion_again",
            "log_extra/completion",
            "log_extra/advantage",
            "log_extra/step",
        }
        for r in table:  # each logged column lines up with its row, on every process's rows
            assert r["completion_again"] == r["completion"] and r["says_the"] == ("the" in r["completion"].split())
            assert r["log_extra/completion"] == "not the completion" and r["log_extra/advantage"] == 1e9
            assert r["the_reward"] == float(r["says_the"])
            assert r["async_length_reward"] == len(r["completion"].split())
        assert row["log_metric/fraction_saying_the"] == pytest.approx(sum(r["says_the"] for r in table) / len(table))
        assert row["log_metric/reward"] == -1e9 and row["log_metric/episode"] == -1  # a function's, under its own name
        assert row["episode"] == update * prompts_per_update * G
        assert row["reward"] == pytest.approx(
            sum(r["curriculum_reward"] + r["the_reward"] + r["async_length_reward"] for r in table) / len(table),
            rel=1e-5,
        )
        for g in range(prompts_per_update):  # leave-one-out advantages of a group sum to 0
            assert sum(r["advantage"] for r in table[g * G : (g + 1) * G]) == pytest.approx(0, abs=1e-4)
    assert "training completions at episode" in proc.stdout
    # what reward functions logged on the greedy sample prompts did not leak into the update's table or metrics
    assert len(jsonl(os.path.join(run_dir, "samples.jsonl"))) >= 4


def test_normalize_advantages_with_the_rloo_estimator_is_trls():
    """TRL's RLOOTrainer: leave-one-out advantages, then (A - mean) / (std + 1e-4) over the batch."""
    rewards = torch.tensor([1.0, 2.0, 0.5, 4.0, 3.0, 3.5, 0.0, 1.0])
    in_loss = torch.ones(8, dtype=torch.bool)
    # by hand: r_i minus the mean of the other 3 of its group (each group's rewards sum to 7.5), in sixths
    loo = torch.tensor([-7.0, 1.0, -11.0, 17.0, 9.0, 13.0, -15.0, -7.0]) / 6
    # each group's advantages sum to 0, so the batch mean is 0; the sample std is sqrt(984 / 36 / 7) = 1.976047
    expected = loo / (1.976047 + 1e-4)
    advantages = rloo.compute_advantages(rewards, torch.zeros(8, 1), in_loss, 4, "rloo", "batch")[:, 0]
    torch.testing.assert_close(advantages, expected)
    args = rloo.resolve_defaults(rloo.Args(normalize_advantages=True))
    check_args(rloo.Args(normalize_advantages=True))  # allowed, as in TRL
    assert args.advantage_estimator == "rloo" and args.advantage_normalization == "batch"


def test_sampling_options_reach_hf_generate_and_vllm(tiny):
    """--min_p, --repetition_penalty and --generation_kwargs go to HF's GenerationConfig (and change what is sampled)
    and to vLLM's SamplingParams, built as rloo_vllm.py builds them (the real vLLM package)."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    tokenizer = tiny["tokenizer"]
    prompt = tokenizer(["the movie was"] * 8, return_tensors="pt")

    def sample(**options):
        args = rloo.Args(**options)
        config, _, _ = generation_configs(
            [tokenizer.eos_token_id],
            tokenizer.pad_token_id,
            **keywords_of(generation_configs, args, filters=args.filters()),
        )
        torch.manual_seed(0)
        out = policy.generate(**prompt, generation_config=config)[:, prompt["input_ids"].shape[1] :]
        eos = tokenizer.eos_token_id
        return config, [row[: row.index(eos) + 1] if eos in row else row for row in out.tolist()]  # up to the EOS

    config, plain = sample(max_completion_length=24, temperature=2.0)
    assert any(len(set(row)) < len(row) for row in plain)  # at temperature 2 some token comes twice...
    config, no_repeats = sample(
        max_completion_length=24,
        temperature=2.0,
        min_p=0.01,
        repetition_penalty=1.3,
        generation_kwargs={"no_repeat_ngram_size": 1},
    )
    assert (config.min_p, config.repetition_penalty, config.no_repeat_ngram_size) == (0.01, 1.3, 1)
    assert all(len(set(row)) == len(row) for row in no_repeats)  # ...never with no_repeat_ngram_size 1
    from vllm import SamplingParams

    args = rloo_vllm.Args(
        model_name_or_path=tiny["policy"],
        min_p=0.05,
        repetition_penalty=1.1,
        generation_kwargs={"frequency_penalty": 0.5, "presence_penalty": 0.25},
    )
    check_args(args)
    check_vllm_args(args, server=False)
    options = sampling_options([0], greedy=False, **keywords_of(sampling_options, args))
    params = SamplingParams(**options, seed=1, detokenize=False)
    assert (params.min_p, params.repetition_penalty, params.frequency_penalty, params.presence_penalty) == (
        0.05,
        1.1,
        0.5,
        0.25,
    )
    greedy = sampling_options(
        [0], greedy=True, **keywords_of(sampling_options, args)
    )  # the engine check compares plain greedy log-probs
    assert "repetition_penalty" not in greedy and "frequency_penalty" not in greedy
    with pytest.raises(UsageError, match="no_repeat_ngram_size is not an option of vLLM's SamplingParams"):
        check_vllm_args(dataclasses.replace(args, generation_kwargs={"no_repeat_ngram_size": 2}), server=False)


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_prompts_and_the_reward_model(tiny):
    """Qwen3's enable_thinking=False: the template then closes an empty thought before the completion."""
    tokenizer = tiny["tokenizer"]
    tokenizer.chat_template = THINKING_TEMPLATE
    chat = [[{"role": "user", "content": "the movie was"}]]
    plain, _, _, _ = tokenize_prompts(tokenizer, chat, 64, "cpu")
    no_thinking, _, _, _ = tokenize_prompts(tokenizer, chat, 64, "cpu", chat_template_kwargs={"enable_thinking": False})
    assert "<think></think>" not in tokenizer.decode(plain[0]) and tokenizer.decode(no_thinking[0]).endswith(
        "<think></think>"
    )
    ids, _ = reward_model_inputs(tokenizer, chat, ["good"], torch.tensor([True]), {"enable_thinking": False})
    assert (
        tokenizer.decode(ids[0]).count("<|im_start|>") == 2
    )  # the reward model reads the conversation, template args and all


def custom_code_model(tiny, folder) -> str:
    """The tiny policy as a model transformers does not know: its config and class come from code in its folder."""
    shutil.copytree(tiny["policy"], folder)
    with open(os.path.join(folder, "configuration_tiny.py"), "w") as f:
        f.write(
            "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tiny_custom'\n"
        )
    with open(os.path.join(folder, "modeling_tiny.py"), "w") as f:
        f.write(
            "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
            "class TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n"
        )
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config.update(
        model_type="tiny_custom",
        architectures=["TinyForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny.TinyConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        },
    )
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.mark.slow
def test_trust_remote_code_loads_a_model_with_its_own_code(tiny, prompts_file, tmp_path):
    """Refused in one line without --trust_remote_code; with it, trained by rloo.py and by 2 processes of
    rloo_multigpu.py (which builds the model empty from its config), and saved with its code."""
    from transformers import AutoModelForCausalLM

    model = custom_code_model(tiny, tmp_path / "custom")
    common = [
        "--model_name_or_path",
        model,
        "--dataset_name",
        prompts_file,
        "--total_episodes",
        32,
        "--max_completion_length",
        8,
        "--num_sample_generations",
        0,
        "--attn_implementation",
        "eager",
    ]
    check_one_line_error(run_rloo(*common, cwd=tmp_path), "trust_remote_code")
    proc = run_rloo(*common, "--trust_remote_code", "--run_name", "one", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_torchrun(
        2, *common, "--per_device_train_batch_size", 8, "--trust_remote_code", "--run_name", "two", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for run in ("one", "two"):
        saved = tmp_path / "runs" / run / "model"
        assert (saved / "modeling_tiny.py").exists() and (saved / "configuration_tiny.py").exists()
        assert json.load(open(saved / "config.json"))["model_type"] == "tiny_custom"
        assert type(AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True)).__name__ == "TinyForCausalLM"
    check_one_line_error(
        run_rloo(*common[:-1], "no_such_kernel", "--trust_remote_code", cwd=tmp_path), "no_such_kernel"
    )


def hub_cache_with_two_revisions(tiny, cache) -> None:
    """A hub model in the local cache (as a download leaves it) at two revisions: `main`, broken (no weights), and
    `v2`, the tiny policy."""
    repo = os.path.join(cache, "models--someone--tiny")
    for revision in ("main", "v2"):
        commit = hashlib.sha1(revision.encode()).hexdigest()
        shutil.copytree(tiny["policy"], os.path.join(repo, "snapshots", commit))
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", revision), "w") as f:
            f.write(commit)
        if revision == "main":
            os.remove(os.path.join(repo, "snapshots", commit, "model.safetensors"))


@pytest.mark.slow
def test_model_revision_picks_the_version_every_load_reads(tiny, prompts_file, tmp_path):
    """--model_revision v2 reaches the config, the tokenizer and the weights, in one process and in two (which read
    the weights' files themselves); without it, main is read (and fails here, having no weights)."""
    cache = str(tmp_path / "hub")
    hub_cache_with_two_revisions(tiny, cache)
    env = {**run_env(), "HF_HUB_CACHE": cache}
    common = [
        sys.executable,
        os.path.join(ROOT, "rloo.py"),
        "--model_name_or_path",
        "someone/tiny",
        "--dataset_name",
        prompts_file,
        "--total_episodes",
        32,
        "--max_completion_length",
        8,
        "--num_sample_generations",
        0,
    ]
    run = lambda *extra: subprocess.run(
        [*map(str, common), *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,  # noqa: E731
        text=True,
        timeout=600,
    )
    check_one_line_error(run("--run_name", "main"), "could not load")
    proc = run("--model_revision", "v2", "--run_name", "v2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_torchrun(
        2,
        *common[2:],
        "--per_device_train_batch_size",
        8,
        "--model_revision",
        "v2",
        "--run_name",
        "v2_two",
        cwd=tmp_path,
        env={"HF_HUB_CACHE": cache},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_one_line_error(run("--model_revision", "v3", "--run_name", "v3"), "could not load")


def trl_config_fields() -> list[str]:
    """RLOOConfig's own fields in TRL 1.16 (not those of transformers' TrainingArguments), read in TRL's environment."""
    trl_python = os.path.join(ROOT, ".venv-trl", "bin", "python")
    assert os.access(trl_python, os.X_OK), "make TRL's environment first: see benchmark/requirements-trl.txt"
    code = (
        "import dataclasses, trl, transformers; own = {f.name for f in dataclasses.fields(trl.RLOOConfig)} - "
        "{f.name for f in dataclasses.fields(transformers.TrainingArguments)}; print(' '.join(sorted(own)))"
    )
    proc = subprocess.run([trl_python, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def migration_table() -> dict[str, str]:
    """The migration table of docs/options.md: TRL's option -> what to give here (or why not)."""
    with open(os.path.join(ROOT, "docs", "options.md")) as f:
        options = f.read()
    section = options[options.index("<!-- migration table -->") :]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (.+) \|$", section, flags=re.M)
    return dict(rows)


def test_the_migration_table_maps_every_rlooconfig_field_of_trl():
    """Every field RLOOConfig adds to TrainingArguments (TRL 1.16), and the TrainingArguments fields a TRL user sets,
    has a row; every flag a row names is an option of the scripts."""
    table = migration_table()
    missing = sorted(set(trl_config_fields()) - set(table))
    assert not missing, f"the migration table (docs/options.md) has no row for {missing}"
    for name in [
        "learning_rate",
        "lr_scheduler_type",
        "lr_scheduler_kwargs",
        "warmup_steps",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "max_grad_norm",
        "seed",
        "bf16",
        "gradient_checkpointing",
        "report_to",
        "output_dir",
        "save_steps",
        "save_total_limit",
        "resume_from_checkpoint",
        "run_name",
        "weight_decay",
        "model_name_or_path",
        "model_revision",
        "dtype",
        "trust_remote_code",
        "attn_implementation",
        "use_peft",
    ]:
        assert name in table, name
    import typing

    import rloo_multigpu

    options = set()
    for script in (rloo, rloo_vllm, rloo_multigpu):
        for name, hint in typing.get_type_hints(script.Args, include_extras=True).items():  # names and aliases
            options |= {
                name,
                *(a.lstrip("-") for m in getattr(hint, "__metadata__", ()) for a in getattr(m, "aliases", None) or ()),
            }
    for trl_name, ours in table.items():
        for flag in re.findall(r"`--([a-z0-9_]+)[` ]", ours):
            assert flag in options, f"the row of {trl_name} names --{flag}, which no script has"


def test_what_reward_functions_log_is_checked_and_kept_whole(tmp_path):
    """An async function's sys.exit is one line (not the end of the run); a log_extra column of the wrong length is
    one line; numpy values a function logs go to completions.jsonl as numbers."""
    import numpy as np

    async def exits(**kwargs):
        raise SystemExit(0)

    for timeout in (None, 5.0):  # (with a --reward_timeout, the event loop runs in a thread of its own)
        with pytest.raises(UsageError, match=r"reward function exits called sys.exit\(0\)"):
            call_reward_funcs([exits], ["exits"], 2, timeout, completions=["a", "b"])
    logs = RewardLogs()
    logs.log_extra("short", [1])
    with pytest.raises(RunError, match="log_extra\\('short', values\\) gave 1 values for 2 completions"):
        logs.take(2)
    logger = logger_in(tmp_path)
    logger.log_table("completions", [{"prompt": "p", "completion": "c", "ok": np.bool_(True), "n": np.int64(3)}], 8)
    logger.close()
    assert jsonl(tmp_path / "completions.jsonl") == [{"step": 8, "prompt": "p", "completion": "c", "ok": True, "n": 3}]


def test_a_resumed_run_cuts_every_table_back_to_its_checkpoint(tmp_path):
    """A table begun or grown after the checkpoint (--log_completions may be added at resume) is cut back, so no row
    appears twice."""
    logger = logger_in(tmp_path)
    logger.log_table("samples", [{"prompt": "p", "completion": "c", "reward": 1.0}], 0)
    state = logger.state()  # the checkpoint: one sample row, no completions table yet
    logger.log_table("samples", [{"prompt": "p", "completion": "d", "reward": 0.0}], 16)
    logger.log_table("completions", [{"prompt": "p", "completion": "d", "advantage": 0.5}], 16)
    logger.close()
    logger_in(tmp_path, resume=state).close()
    assert [r["step"] for r in jsonl(tmp_path / "samples.jsonl")] == [0]
    assert jsonl(tmp_path / "completions.jsonl") == []


def test_a_run_of_an_earlier_version_is_refused_and_the_embedded_dataset_matches_by_path(tmp_path):
    """An args.json that lacks an option added since (an earlier version of this project wrote it) is refused in one
    line; the embedded dataset named by its absolute path is the same dataset; a changed option is refused."""
    args = rloo.resolve_defaults(rloo.Args())
    saved = json.loads(json.dumps(dataclasses.asdict(args)))
    saved["dataset_name"] = os.path.join(ROOT, "data", "movie_reviews")
    (tmp_path / "args.json").write_text(json.dumps(saved))
    check_resumable(dataclasses.asdict(args), str(tmp_path), resumable_options(rloo.Args))
    with pytest.raises(UsageError, match="--repetition_penalty is 1.1 here but 1.0 in"):
        check_resumable(
            dataclasses.asdict(dataclasses.replace(args, repetition_penalty=1.1)),
            str(tmp_path),
            resumable_options(rloo.Args),
        )
    del saved["min_p"], saved["reward_timeout"]  # reward_timeout may change on resume: its absence is no matter
    (tmp_path / "args.json").write_text(json.dumps(saved))
    with pytest.raises(
        UsageError,
        match=re.escape(
            f"{tmp_path} has no --min_p in its args.json: another script or an earlier version of this project wrote it"
        ),
    ):
        check_resumable(dataclasses.asdict(args), str(tmp_path), resumable_options(rloo.Args))


def test_generation_kwargs_go_to_the_generator_that_samples():
    """rloo_multigpu.py generates with HF generate unless a vLLM server does: GenerationConfig's keys, then
    SamplingParams' (vLLM installed or not)."""
    import rloo_multigpu

    hf = rloo_multigpu.Args(generation_kwargs={"no_repeat_ngram_size": 3, "epsilon_cutoff": 3e-4})
    check_args(hf)
    check_vllm_args(hf, server=False)
    served = dataclasses.replace(hf, vllm_server_host="127.0.0.1")
    with pytest.raises(UsageError, match="is not an option of vLLM's SamplingParams"):
        check_vllm_args(served, server=True)
