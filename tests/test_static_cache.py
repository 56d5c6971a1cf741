"""HF generate with a static KV cache and a compiled decoding step (--cache_implementation static; auto: on CUDA) gives
the completions of the dynamic cache, greedy token for token and sampled from the same seeds, in every chunk of a
rollout's rows; and the decoding step is traced once per batch-size bucket, whatever the prompts' lengths. On a CPU
the compiled step is inductor's C++ (the GPU's is CUDA graphs: the kit times it, benchmark/gpu/check.py)."""

import contextlib
import types

import pytest
import torch


import rloo
from rloo_utils.data import left_pad
from rloo_utils.generation import SamplingFilters, generation_configs, static_cache, static_cache_inputs
from rloo_utils.rollouts import HFSampler


# Plain sampling: no filter (GenerationOptions' defaults)
PLAIN = SamplingFilters(top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, generation_kwargs=None)
LENGTHS = dict(max_prompt_length=16, max_completion_length=8, chat_template_kwargs=None)  # a Sampler's limits
# The line a run prints where its HF generate keeps the static cache (the dynamic one, the default, says nothing)
STATIC_SAID = "HF generate keeps a static KV cache, its decoding step compiled"


def cache_said(output: str) -> list[str]:
    """The lines a run printed of its KV cache."""
    return [line for line in output.splitlines() if "KV cache" in line]


def plain_configs(eos: int, pad_token_id: int, static: bool):
    """generation_configs' (sampling, greedy, evaluation) of 8 tokens at temperature 1, without filters."""
    return generation_configs(
        [eos],
        pad_token_id,
        None,
        static,
        max_completion_length=8,
        temperature=1.0,
        eval_temperature=None,
        filters=PLAIN,
    )


def sampler_and_configs(tiny, chunk: int, static: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
    eos = tokenizer.eos_token_id
    models = types.SimpleNamespace(tokenizer=tokenizer, processor=None)
    plan = types.SimpleNamespace(tool_use=None, image_column=None)
    sampler = HFSampler(
        policy,
        models,
        plan,
        [eos],
        [eos],
        torch.device("cpu"),
        contextlib.nullcontext,
        forward_batch_size=chunk,
        temperature=1.0,
        **LENGTHS,
    )
    sampling, greedy, _ = plain_configs(eos, tokenizer.pad_token_id, static)
    return sampler, sampling, greedy


def prompts(tokenizer, lengths: list[int], seed: int = 0):
    """Left-padded (b, P) prompts of random ids, of these lengths."""
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(10, len(tokenizer) - 1, (n,), generator=generator).tolist() for n in lengths]
    return left_pad(rows, tokenizer.pad_token_id)


def test_static_cache_completions_are_the_dynamic_cache_s_greedy_and_sampled(tiny):
    dynamic, sampling, greedy = sampler_and_configs(tiny, 4, static=False)
    static, static_sampling, static_greedy = sampler_and_configs(tiny, 4, static=True)
    assert static_greedy.cache_implementation == "static" and greedy.cache_implementation is None
    ids, mask = prompts(dynamic.tokenizer, [5, 9, 2, 7, 3, 6, 4])  # chunks of 4 and 3 rows (the 3 padded to 4)
    expected, _ = dynamic.generate(ids, mask, greedy)
    got, _ = static.generate(ids, mask, static_greedy)
    assert got.shape == expected.shape == (7, 8)
    assert torch.equal(got, expected)
    # Sampled from the same seeds: the same tokens where no row was added (a chunk of 4); the added rows take draws
    # of the generator, so the chunk of 3 samples other completions (test_padded_rows_sample_from_the_policy)
    seeds = [11, 12, 13, 14, 15, 16, 17]  # each chunk samples from its first row's seed
    expected, _ = dynamic.generate(ids, mask, sampling, seeds=seeds)
    got, _ = static.generate(ids, mask, static_sampling, seeds=seeds)
    assert torch.equal(got[:4], expected[:4])
    assert not torch.equal(expected, dynamic.generate(ids, mask, sampling, seeds=[21, 22, 23, 24, 25, 26, 27])[0])


def sampled_logprobs(sampler, config, ids, mask, seed: int) -> torch.Tensor:
    """The (b, C) log-probs, under the policy's own forward, of the tokens the sampler drew (0 after the end)."""
    from rloo_utils.rollouts import completion_mask_from

    completions, _ = sampler.generate(ids, mask, config, seeds=[seed] * len(ids))
    completion_mask, _ = completion_mask_from(completions, sampler.stop_ids, sampler.eos_ids)
    with torch.no_grad():
        return rloo.completion_logprobs(sampler.policy, ids, mask, completions, completion_mask.long(), 1.0)


def mean_logprob(sampler, config, ids, mask, calls: int) -> tuple[float, float]:
    """The mean log-prob of the tokens drawn in `calls` rollouts of the prompts (per completion: its tokens' mean), and
    its standard error."""
    means = []
    for seed in range(calls):
        logprobs = sampled_logprobs(sampler, config, ids, mask, seed)  # (b, C)
        means += (logprobs.sum(1) / (logprobs != 0).sum(1).clamp(min=1)).tolist()
    means = torch.tensor(means)
    return float(means.mean()), float(means.std() / len(means) ** 0.5)


@pytest.mark.slow  # 60 rollouts of 7 completions, in-process (about 20 s)
def test_padded_rows_sample_from_the_policy(tiny):
    """7 rows sampled in a chunk of 8 (one row added): each completion token is a draw from the policy's distribution
    after its context, so the mean log-prob of the drawn tokens is -(the policy's entropy) in expectation, as from the
    dynamic cache; tokens drawn from another position's logits, or at another temperature, are less likely (the
    control: at temperature 1.5 the same statistic moves by well over 4 standard errors)."""
    import copy

    dynamic, sampling, _ = sampler_and_configs(tiny, 8, static=False)
    static, static_sampling, _ = sampler_and_configs(tiny, 8, static=True)
    with torch.no_grad():  # a sharper distribution than the tiny model's near-uniform one: tokens' log-probs differ
        dynamic.policy.lm_head.weight.mul_(2.0)
    static.policy.load_state_dict(dynamic.policy.state_dict())
    ids, mask = prompts(dynamic.tokenizer, [5, 9, 2, 7, 3, 6, 4])
    expected, expected_error = mean_logprob(dynamic, sampling, ids, mask, 20)
    got, got_error = mean_logprob(static, static_sampling, ids, mask, 20)
    assert abs(got - expected) < 4 * (expected_error**2 + got_error**2) ** 0.5, (got, expected)
    hot = copy.deepcopy(sampling)
    hot.temperature = 1.5
    control, control_error = mean_logprob(dynamic, hot, ids, mask, 20)
    assert abs(control - expected) > 4 * (expected_error**2 + control_error**2) ** 0.5, (control, expected)


def test_the_decoding_step_sees_a_few_batch_sizes_and_is_compiled_a_few_times_whatever_the_rows(tiny):
    """Rows of any count (a dynamic-sampling round, a tool turn) and prompts of any length: generate sees batches of
    1, 2, 4 or 8 rows (a chunk of 8), each a CUDA graph of its own on a GPU; dynamo compiles the step at most once per
    bucket (its guards then mark the batch dynamic: fewer), and not for a prompt's length within a bucket of 64."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    sampler, _, greedy = sampler_and_configs(tiny, 8, static=True)
    batches = []
    generate = sampler.policy.generate
    sampler.policy.generate = lambda input_ids, **kwargs: (
        batches.append(len(input_ids)) or generate(input_ids, **kwargs)
    )
    torch._dynamo.reset()
    counters.clear()
    for rows in range(1, 9):
        lengths = [1 + (3 * rows + 5 * i) % 16 for i in range(rows)]  # 1 to 16 tokens
        ids, mask = prompts(sampler.tokenizer, lengths, seed=rows)
        out, _ = sampler.generate(ids, mask, greedy)
        assert out.shape == (rows, 8)
    assert batches == [1, 2, 4, 4, 8, 8, 8, 8]
    assert 1 <= counters["stats"]["unique_graphs"] <= 4
    ids, mask = prompts(sampler.tokenizer, [70, 3])  # a prompt past the first bucket: a longer cache, traced anew
    assert sampler.generate(ids, mask, greedy)[0].shape == (2, 8)
    assert counters["stats"]["unique_graphs"] <= 5


def test_rows_are_padded_to_a_power_of_two_up_to_the_chunk_and_the_cache_to_a_bucket_only_when_static():
    ids, mask = torch.arange(15).view(5, 3), torch.ones(5, 3, dtype=torch.long)
    static = types.SimpleNamespace(cache_implementation="static", max_new_tokens=8)
    inputs = static_cache_inputs(ids, mask, static, 64)
    assert inputs["input_ids"].shape == inputs["attention_mask"].shape == (8, 3)
    assert torch.equal(inputs["input_ids"][:5], ids) and (inputs["input_ids"][5:] == ids[-1]).all()
    assert inputs["max_cache_len"] == 64 + 8  # prompts of 3 tokens: the first bucket, and the completion
    assert static_cache_inputs(torch.ones(2, 65, dtype=torch.long), mask, static, 64)["max_cache_len"] == 128 + 8
    assert static_cache_inputs(ids, mask, static, 6)["input_ids"].shape == (6, 3)  # never more rows than the chunk
    dynamic = static_cache_inputs(ids, mask, types.SimpleNamespace(cache_implementation=None), 64)
    assert dynamic.keys() == {"input_ids", "attention_mask"} and dynamic["input_ids"] is ids


@pytest.mark.parametrize(
    "option, device, unsupported, bf16, dtype, expected",
    [
        ("auto", "cpu", None, False, torch.float32, False),
        ("auto", "cuda", None, False, torch.float32, True),
        ("auto", "cuda", None, True, torch.bfloat16, True),
        ("static", "cpu", None, False, torch.float32, True),
        ("dynamic", "cuda", None, False, torch.float32, False),
        ("auto", "cuda", "image prompts", False, torch.float32, False),
        # autocast over float32 weights: RoPE's float32 keys and bfloat16 values in one cache (failed on an H200)
        ("auto", "cuda", None, True, torch.float32, False),
        ("static", "cpu", None, True, torch.float32, False),
    ],
)
def test_which_runs_keep_a_static_cache(option, device, unsupported, bf16, dtype, expected, monkeypatch):
    from rich.console import Console

    from rloo_utils import generation

    monkeypatch.setattr(
        generation, "compile_failure", lambda device: None
    )  # torch.compile builds for every device here
    console = Console(record=True, width=200)
    assert static_cache(option, torch.device(device), console, dtype, unsupported, autocast=bf16) is expected
    said = console.export_text()
    if expected:
        assert said == STATIC_SAID + "\n"
    elif option == "dynamic" or (option == "auto" and device == "cpu"):
        assert said == ""
    elif unsupported:
        assert said == "HF generate keeps a dynamic KV cache, uncompiled: image prompts\n"
    else:
        assert said.startswith("HF generate keeps a dynamic KV cache, uncompiled: --bf16 computes in bfloat16 over ")


def test_a_device_torch_compile_cannot_build_for_keeps_the_dynamic_cache_in_one_line(monkeypatch):
    from rich.console import Console

    from rloo_utils import generation

    failure = "InductorError: InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx"
    monkeypatch.setattr(generation, "compile_failure", lambda device: failure)
    console = Console(record=True, width=400)
    assert static_cache("static", torch.device("cpu"), console, torch.float32, None, autocast=False) is False
    assert console.export_text() == (
        f"HF generate keeps a dynamic KV cache, uncompiled: torch.compile cannot build the decoding step on cpu "
        f"({failure})\n"
    )
    # not asked for: not probed, nothing said
    assert static_cache("dynamic", torch.device("cpu"), console, torch.float32, None, autocast=False) is False
    assert console.export_text() == ""


@pytest.mark.slow
def test_a_static_cache_run_without_a_c_compiler_says_so_in_one_line_and_samples_with_the_dynamic_cache(
    tiny, prompts_file, tmp_path, monkeypatch
):
    """Inductor builds a CPU step with the C++ compiler of $CXX: none there, the run's first rollout died in a traceback
    of ~110 lines (issue 68). Now compile_failure finds it at start, and the run goes on with the dynamic cache. A fresh
    inductor cache, so that no kernel built before hides the missing compiler."""
    from conftest import run_rloo

    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("CC", "/nonexistent/gcc")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("COLUMNS", "400")  # rich's lines unwrapped
    proc = run_rloo(
        *("--model_name_or_path", tiny["policy"], "--reward_model_path", tiny["reward"]),
        *("--dataset_name", prompts_file, "--total_episodes", 8, "--num_generations", 2, "--max_prompt_length", 16),
        *("--max_completion_length", 8, "--per_device_train_batch_size", 8, "--cache_implementation", "static"),
        *("--run_name", "run"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert cache_said(proc.stdout) == [
        "HF generate keeps a dynamic KV cache, uncompiled: torch.compile cannot build the decoding step on cpu "
        "(InductorError: InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: "
        "(None, '/nonexistent/g++'))"
    ], proc.stdout


def test_a_vllm_run_refuses_the_option_in_one_line():
    import rloo_vllm
    from rloo_utils.errors import UsageError
    from rloo_utils.checks import check_args

    with pytest.raises(UsageError, match="--cache_implementation static is HF generate's, and this run generates"):
        check_args(rloo_vllm.Args(cache_implementation="static"))


def cache_run(script_run, tiny, data, cwd, option: str):
    """A run of 2 updates of 16 completions (of one update of 16 on each of 2 processes), generated in chunks of 10
    and 6 rows (the 6 padded to 8), with a sample table of 3 prompts (padded to 4) before and after."""
    proc = script_run(
        *("--model_name_or_path", tiny["policy"], "--dataset_name", data, "--reward_model_path", tiny["reward"]),
        *("--total_episodes", 32, "--num_generations", 4, "--max_completion_length", 8, "--max_prompt_length", 16),
        *("--per_device_train_batch_size", 8, "--gradient_accumulation_steps", 2),
        *("--local_rollout_forward_batch_size", 10),
        *("--num_sample_generations", 1, "--num_sample_prompts", 3, "--cache_implementation", option),
        *("--run_name", "run", "--seed", 3),
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "rloo_multigpu.py on 2 processes"])
def test_a_run_with_a_static_cache_samples_the_dynamic_run_s_greedy_tables(script, tiny, prompts_file, tmp_path):
    """The whole rollout path (chunks, rows added, rloo_multigpu.py's gathered policy under synced_gpus): greedy
    tables equal; the sampled rollouts are other draws of the same policy, so the runs' rewards differ (a static run
    that quietly ran dynamic would log the dynamic run's numbers); and the static run says it kept the static cache
    (once: rank 0's line), the dynamic one says nothing of its cache."""
    from conftest import run_outcome, run_rloo
    from test_multigpu import run_torchrun

    script_run = run_rloo if script == "rloo.py" else lambda *args, cwd: run_torchrun(2, *args, cwd=cwd)  # noqa: E731
    outcomes, said = {}, {}
    for option in ("dynamic", "static"):
        (tmp_path / option).mkdir()
        proc = cache_run(script_run, tiny, prompts_file, tmp_path / option, option)
        outcomes[option] = run_outcome(str(tmp_path / option / "runs" / "run"))
        said[option] = cache_said(proc.stdout + proc.stderr)
    assert said == {"dynamic": [], "static": [STATIC_SAID]}, said
    (dynamic_metrics, dynamic_tables, _), (static_metrics, static_tables, _) = outcomes["dynamic"], outcomes["static"]
    assert static_tables == dynamic_tables and len(static_tables.splitlines()) == 2 * 3  # before and after, 3 prompts
    assert [m["reward"] for m in static_metrics] != [m["reward"] for m in dynamic_metrics]
