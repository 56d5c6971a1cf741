"""rloo_vllm.py with the real vLLM (the CPU build here): weights reach the engine, in both modes; runs learn; a resumed
run is the run it would have been; bad vLLM settings and a missing server are one line.

The server tests start vLLM's own OpenAI-compatible server on the tiny model (SERVER_COMMAND) and stop it at
the end, whatever happens.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import torch

from conftest import (
    ROOT,
    check_learned,
    check_one_line_error,
    free_port,
    keywords_of,
    learning_task,
    read_metrics,
    run_env,
    run_outcome,
    run_rloo,
    start_vllm_server,
    wait_for_updates,
)

import rloo_vllm
from rloo_utils.vllm_colocated import ColocatedVLLM
from rloo_utils.errors import UsageError
from rloo_utils.checks import check_args
from rloo_utils.vllm_options import check_vllm_args
from rloo_utils.vllm_sampling import check_engine, pad_completions, sampler_support, sampling_options, sampling_seeds
from rloo_utils.vllm_server import VLLMServer
from rloo_utils.weight_transfer import (
    NCCL_SERVER_OPTION,
    nccl_workers,
    rendezvous_address,
    uses_nccl,
    weights_for_vllm,
)
from rloo_utils.generation import tokenize_prompts
from rloo_utils.packing import logprobs_through_output_layer

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")
PROMPTS = ["the movie was", "a very long film and", "it is"]


def vllm_args(tiny, **kwargs) -> rloo_vllm.Args:
    return rloo_vllm.Args(model_name_or_path=tiny["policy"], max_prompt_length=32, max_completion_length=16, **kwargs)


def hf_greedy(policy, tokenizer, n: int) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out.append(
            policy.generate(
                ids, max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=tokenizer.pad_token_id
            )[0, ids.shape[1] :].tolist()
        )
    return out


def engine_greedy(engine, tokenizer, args) -> list[list[int]]:
    options = sampling_options([], greedy=True, **keywords_of(sampling_options, args))  # no end token: always C
    return [ids for ids, _ in engine.generate([tokenizer(p).input_ids for p in PROMPTS], options, None)]


def perturb(policy, seed: int, scale: float = 0.05) -> None:
    """A stand-in for an update that moves every weight (the tied embedding / LM head included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)


def check_pushes(engine, tiny, args, monkeypatch):
    """After each push the engine's greedy output is the policy's, and it differs from the output before the update;
    a push that leaves out lm_head.weight (save_pretrained's way with tied embeddings) is caught."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    assert policy.config.tie_word_embeddings
    engine.push_weights(policy, weights_for_vllm(policy, engine.dtype))
    before = engine_greedy(engine, tokenizer, args)
    assert before == hf_greedy(policy, tokenizer, args.max_completion_length)

    perturb(policy, seed=1)
    after_hf = hf_greedy(policy, tokenizer, args.max_completion_length)
    assert after_hf != before  # the update changes the greedy output...
    assert engine_greedy(engine, tokenizer, args) == before  # ...which the engine shows only once pushed
    engine.push_weights(policy, weights_for_vllm(policy, engine.dtype))
    assert engine_greedy(engine, tokenizer, args) == after_hf

    # The same push without the LM head: the engine keeps its old head and no longer samples from the policy
    probe = tokenize_prompts(tokenizer, PROMPTS, args.max_prompt_length, torch.device("cpu"))[:2]
    logprobs_of = lambda *rollout: rloo_vllm.completion_logprobs(policy, *rollout, temperature=1.0)  # noqa: E731
    options = sampling_options([], greedy=True, **keywords_of(sampling_options, args))
    check_engine(engine, *probe, options, logprobs_of)  # a complete push passes
    with torch.no_grad():
        policy.get_input_embeddings().weight.mul_(-1.0)
    engine.push_weights(policy, {k: v for k, v in policy.state_dict().items() if k != "lm_head.weight"})
    assert engine_greedy(engine, tokenizer, args) != hf_greedy(policy, tokenizer, args.max_completion_length)
    with pytest.raises(UsageError, match="does not sample from the policy"):
        check_engine(engine, *probe, options, logprobs_of)
    engine.push_weights(policy, weights_for_vllm(policy, engine.dtype))
    assert engine_greedy(engine, tokenizer, args) == hf_greedy(policy, tokenizer, args.max_completion_length)


@pytest.mark.slow  # the engine's first start inspects the model in a vLLM subprocess (none in the fast tier)
def test_colocated_engine_samples_from_the_pushed_weights(tiny, monkeypatch):
    from transformers import AutoModelForCausalLM

    args = vllm_args(tiny)
    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    engine = ColocatedVLLM(args, policy, torch.device("cpu"))
    try:
        check_pushes(engine, tiny, args, monkeypatch)
        # The sampling log-probs are the policy's at the sampling temperature (logprobs_mode processed_logprobs)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
        policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
        engine.push_weights(policy, weights_for_vllm(policy, engine.dtype))
        args = vllm_args(tiny, temperature=0.7)
        prompt_ids, prompt_mask, _, _ = tokenize_prompts(tokenizer, PROMPTS, 32, torch.device("cpu"))
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        outputs = engine.generate(
            prompts, sampling_options([], greedy=False, **keywords_of(sampling_options, args)), [1, 2, 3]
        )
        completion_ids, sampling_logprobs = pad_completions(outputs, 16, 0, [], torch.device("cpu"))
        with torch.no_grad():
            trainer = rloo_vllm.completion_logprobs(
                policy, prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids), 0.7
            )
        assert (trainer - sampling_logprobs).abs().max() < 1e-4
        # One seed per completion: the same seed gives the same completion, another seed another one
        again = engine.generate(
            prompts, sampling_options([], greedy=False, **keywords_of(sampling_options, args)), [1, 2, 4]
        )
        assert again[:2] == outputs[:2] and again[2][0] != outputs[2][0]
    finally:
        engine.close()


@pytest.mark.slow
def test_server_samples_from_the_pushed_weights(tiny, server, monkeypatch):
    args = vllm_args(tiny, vllm_mode="server", vllm_server_base_url=server["url"])
    engine = VLLMServer(args)
    try:
        check_pushes(engine, tiny, args, monkeypatch)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_server_draws_the_samples_of_the_colocated_engine_for_the_same_seeds(tiny, server):
    """A server gets a group as one request for its G completions, seeded with the group's first seed (vLLM seeds
    completion i with seed + i): the samples are those of the colocated engine, seeded per completion. A rollout of more
    prompt tokens than a step holds (4096) runs too: with chunked prefill, vLLM's CPU runner failed seeded requests."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    args = vllm_args(tiny, vllm_mode="server", vllm_server_base_url=server["url"])
    engine = ColocatedVLLM(vllm_args(tiny), policy, torch.device("cpu"))
    remote = VLLMServer(args)
    try:
        engine.push_weights(policy, weights_for_vllm(policy, engine.dtype))
        remote.push_weights(policy, weights_for_vllm(policy, remote.dtype))
        options = sampling_options([], greedy=False, **keywords_of(sampling_options, args))
        prompts = [[5 + p, 6, 7 + p] for p in range(6) for _ in range(4)]  # 6 groups of G = 4
        seeds = sampling_seeds(3, 1, len(prompts))
        assert seeds == list(range(seeds[0], seeds[0] + len(prompts)))
        local = engine.generate(prompts, options, seeds)
        assert local == remote.generate(prompts, options, seeds)
        # the tokens-in route that image prompts take (rows without images here: a text model) draws the same
        assert local == remote.generate(prompts, options, seeds, images=[[]] * len(prompts))
        assert len({tuple(ids) for ids, _ in local[:4]}) == 4  # a group's completions differ
        long_prompts = [[5 + i, *range(6, 35)] for i in range(160)]  # 4800 prompt tokens: one is cut at 4096
        assert [len(ids) for ids, _ in engine.generate(long_prompts, options, list(range(160)))] == [16] * 160
    finally:
        engine.close()
        remote.close()


@pytest.mark.slow
def test_nccl_weight_transfer_checks_the_server_it_is_given(tiny, server):
    """vLLM's NCCL weight transfer needs a GPU, so it cannot run here; what can be checked on CPU is checked: the
    refusal without a GPU, the server's configuration read from its real /server_info, and the address its workers
    connect back to."""
    args = vllm_args(tiny, vllm_mode="server", vllm_server_base_url=server["url"], vllm_server_weight_transfer="nccl")
    with pytest.raises(UsageError, match="sends the weights from a GPU, and there is none"):
        check_vllm_args(args, server=args.vllm_mode == "server")
    assert not uses_nccl("auto")  # auto on CPU: shared memory
    # This server was started without --weight-transfer-config: refused when it is found, with the option to add
    with pytest.raises(UsageError) as e:
        VLLMServer(args)
    assert NCCL_SERVER_OPTION in str(e.value) and "shared_memory" in str(e.value)
    # The same /server_info with the option, on 2 tensor-parallel x 2 data-parallel workers: 4 workers join the group
    info = json.load(urllib.request.urlopen(server["url"] + "/server_info?config_format=json", timeout=60))
    info["vllm_config"]["weight_transfer_config"] = {"backend": "nccl"}
    info["vllm_config"]["parallel_config"].update(world_size=2, data_parallel_size=2)
    assert nccl_workers(info, server["url"]) == 4
    address, port = rendezvous_address(server["url"])
    assert address == "127.0.0.1" and 0 < port < 65536


def learning_args(tiny, data, *extra):
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--reward_funcs",
        f"{REWARDS}:count_good",
        "--total_episodes",
        1280,
        "--per_device_train_batch_size",
        32,
        "--max_completion_length",
        8,
        "--learning_rate",
        "3e-3",
        "--num_generations",
        4,
        "--beta",
        0,
        "--num_sample_generations",
        0,
        "--seed",
        3,
        *extra,
    ]


def check_learns(request, tmp_path):
    rows = read_metrics(tmp_path)
    check_learned(request, [r["reward"] for r in rows], gain=1.0)  # a run that does not learn stays near its first
    # vLLM sampled from the policy being trained: its log-probs are the trainer's, update after update
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows), [
        r["sampling/sampling_logp_difference/max"] for r in rows
    ]
    assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for r in rows)


@pytest.mark.slow
@pytest.mark.learning
def test_a_colocated_run_raises_a_simple_reward(tiny, prompts_file, tmp_path, learning_seed, request):
    """Only happens if every update's weights reach the engine: the samples come from vLLM."""
    proc = run_rloo(*learning_task(tiny["policy"], prompts_file, learning_seed), cwd=tmp_path, script="rloo_vllm.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_learns(request, tmp_path)


@pytest.mark.slow
@pytest.mark.learning
def test_a_server_run_raises_a_simple_reward(tiny, server, prompts_file, tmp_path, learning_seed, request):
    proc = run_rloo(
        *learning_task(tiny["policy"], prompts_file, learning_seed),
        *("--vllm_mode", "server", "--vllm_server_base_url", server["url"]),
        cwd=tmp_path,
        script="rloo_vllm.py",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_learns(request, tmp_path)


@pytest.mark.slow
def test_a_lora_run_samples_from_the_merged_weights_on_the_server(tiny, server, prompts_file, tmp_path):
    """--use_peft pushes the base weights with the adapter merged in (the trained copy left as it is): the server's
    log-probs are the trainer's after every update, while the adapter moves the policy away from the base."""
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--reward_funcs",
        f"{REWARDS}:text_length",
        "--total_episodes",
        96,
        "--per_device_train_batch_size",
        32,
        "--max_completion_length",
        8,
        "--learning_rate",
        "3e-3",
        "--num_sample_generations",
        0,
        "--use_peft",
        "--lora_target_modules",
        "all-linear",
        "--vllm_mode",
        "server",
        "--vllm_server_base_url",
        server["url"],
        cwd=tmp_path,
        script="rloo_vllm.py",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 3 and all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows), rows
    assert rows[-1]["kl"] != 0  # the adapter moved the policy away from its reference, the base


@pytest.mark.slow
@pytest.mark.parametrize("mode, temperature", [("colocate", 0.5), ("server", 2.0)])
def test_a_run_at_any_temperature_passes_the_engine_check_and_samples_at_it(
    mode, temperature, tiny, server, prompts_file, tmp_path
):
    """The engine check compares greedy log-probs with greedy's (temperature 1); the samples' log-probs are the
    trainer's at --temperature."""
    where = ["--vllm_mode", "server", "--vllm_server_base_url", server["url"]] if mode == "server" else []
    proc = run_rloo(
        *learning_args(tiny, prompts_file, "--total_episodes", 64, "--temperature", temperature, *where),
        cwd=tmp_path,
        script="rloo_vllm.py",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:]  # vLLM's chat-template warmup logged one
    rows = read_metrics(tmp_path)
    assert len(rows) == 2 and all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows), rows


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.9, None), (5, 1.0, None), (0, 1.0, 0.2), (7, 0.8, 0.05)])
def test_the_trainer_takes_log_probs_on_the_tokens_vllms_sampler_can_draw(top_k, top_p, min_p):
    """sampler_support keeps the tokens vLLM's own code keeps (vllm/v1/sample: min-p after the temperature, then top-k
    and top-p), and the log-probs renormalised over them are vLLM's processed log-probs."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3 / 0.7  # (k, V), already divided by the temperature
    logits[0, :5] = logits[0, 5]  # ties at the top-k boundary are kept, as vLLM keeps them
    vllm_logits = logits.clone()
    if min_p:  # vLLM's own MinPLogitsProcessor.apply, its per-row min_p set as update_state sets it
        processor = object.__new__(MinPLogitsProcessor)
        processor.min_p, processor.min_p_count = torch.full((6, 1), min_p), 6
        vllm_logits = processor.apply(vllm_logits)
    vllm_logits = apply_top_k_top_p_pytorch(
        vllm_logits,
        torch.full((6,), top_k) if top_k else None,
        torch.full((6,), top_p) if top_p < 1 else None,
        allow_cpu_sync=True,
    )
    kept = sampler_support(top_k, top_p, min_p)(logits)
    assert torch.equal(kept, vllm_logits.isfinite()) and 0 < kept.sum() < kept.numel()
    # The log-probs of drawn tokens on that distribution are vLLM's processed_logprobs
    layer = torch.nn.Linear(40, 40, bias=False)
    torch.nn.init.eye_(layer.weight)
    ids = vllm_logits.argmax(-1)
    _, on_support = logprobs_through_output_layer(
        layer, lambda x: x, logits, ids, 1.0, support=sampler_support(top_k, top_p, min_p)
    )
    torch.testing.assert_close(on_support, vllm_logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1))
    assert sampler_support(0, 1.0, None) is None and sampler_support(0, 1.0, 0.0) is None


@pytest.mark.parametrize(
    "script, mode", [("rloo_vllm.py", "colocate"), ("rloo_vllm.py", "server"), ("rloo_multigpu.py", "server")]
)
@pytest.mark.slow
def test_with_top_p_the_importance_ratio_is_one_before_any_update(script, mode, tiny, server, prompts_file, tmp_path):
    """vLLM's log-probs with --top_p 0.9 are renormalised over the tokens it kept; the trainer's are taken on the same
    distribution, so at the first update (the trainer's weights are the engine's) the mean ratio is 1 to 1e-3. On the
    full distribution it would be the kept mass, about 0.9 a token on the random test model (0.9 ** 16 a completion).
    With an entropy bonus, whose entropies (with a gradient) come beside those log-probs."""
    where = ["--vllm_server_base_url", server["url"]] if mode == "server" else []
    where += ["--vllm_mode", mode] if script == "rloo_vllm.py" else []
    proc = run_rloo(
        *learning_args(
            tiny,
            prompts_file,
            "--total_episodes",
            32,
            "--top_p",
            0.9,
            "--max_completion_length",
            16,
            "--vllm_importance_sampling_mode",
            "sequence_truncate",
            "--entropy_coef",
            0.01,
            *where,
        ),
        cwd=tmp_path,
        script=script,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_metrics(tmp_path)
    assert abs(row["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, row
    assert row["sampling/sampling_logp_difference/mean"] < 1e-3, row
    assert row["loss/entropy_bonus"] > 0, row


@pytest.mark.parametrize("script, mode", [("rloo_vllm.py", "colocate"), ("rloo_multigpu.py", "server")])
@pytest.mark.slow
def test_the_sequence_masks_run_and_keep_what_the_policy_itself_sampled(
    script, mode, tiny, server, prompts_file, tmp_path
):
    """The geometric mask and the off-policy sequence mask in a run: where the sampler is the policy (its weights pushed
    after every update, its numerics the trainer's to ~1e-6) no completion is masked by either, and both shares are
    logged; the masks themselves are tested by hand in tests/test_rollouts.py."""
    where = ["--vllm_server_base_url", server["url"]] if mode == "server" else ["--vllm_mode", mode]
    proc = run_rloo(
        *("--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--total_episodes", 64),
        *(
            "--reward_funcs",
            f"{REWARDS}:text_length",
            "--per_device_train_batch_size",
            32,
            "--max_completion_length",
            8,
        ),
        *("--learning_rate", "3e-3", "--beta", 0, "--num_sample_generations", 0, "--seed", 3, *where),
        *("--vllm_importance_sampling_mode", "sequence_geometric_mask", "--off_policy_mask_threshold", "0.001"),
        cwd=tmp_path,
        script=script,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 2 and all(row["optim/grad_norm"] > 0 for row in rows)  # masked rows would give 0
    for row in rows:
        assert row["sampling/importance_sampling_ratio/clipped_fraction"] == 0, row
        assert row["sampling/off_policy_masked_fraction"] == 0, row
        assert abs(row["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, row


def resume_args(tiny, data, *extra):
    """6 updates of 2 epochs x 2 minibatches with a KL and sample tables, a checkpoint every 3 (as test_resume.py's)."""
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--reward_funcs",
        f"{REWARDS}:slow_text_length",
        "--total_episodes",
        48,
        "--per_device_train_batch_size",
        4,
        "--num_mini_batches",
        2,
        "--num_ppo_epochs",
        2,
        "--max_completion_length",
        8,
        "--learning_rate",
        3e-3,
        "--beta",
        0.1,
        "--num_sample_generations",
        2,
        "--save_steps",
        3,
        "--run_name",
        "run",
        *extra,
    ]


def sigkill_after_updates(args, cwd, n: int) -> None:
    """Run rloo_vllm.py with `args` in cwd (its run folder runs/run) and kill it with SIGKILL once it logged n updates."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "rloo_vllm.py"), *map(str, args)],
        cwd=cwd,
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_updates(proc, cwd / "runs" / "run" / "metrics.jsonl", n)
    proc.kill()
    proc.wait(timeout=60)


@pytest.mark.slow
def test_a_sigkilled_colocated_run_resumes_as_the_same_run(tiny, prompts_file, tmp_path):
    """Each completion's seed depends on (--seed, update, row) only, and the resumed engine gets the checkpoint's
    weights before its first rollout: the resumed run equals the uninterrupted one, metrics and weights."""
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    reference.mkdir(), interrupted.mkdir()
    proc = run_rloo(*resume_args(tiny, prompts_file), cwd=reference, script="rloo_vllm.py")
    assert proc.returncode == 0, proc.stderr[-3000:]

    sigkill_after_updates(resume_args(tiny, prompts_file), interrupted, 4)
    assert sorted(os.listdir(interrupted / "runs" / "run" / "checkpoints")) == ["checkpoint-3"]
    resumed = run_rloo(
        *resume_args(tiny, prompts_file, "--resume_from_checkpoint", "latest"), cwd=interrupted, script="rloo_vllm.py"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, got = run_outcome(str(reference / "runs" / "run")), run_outcome(str(interrupted / "runs" / "run"))
    assert [r["episode"] for r in got[0]] == [8 * i for i in range(1, 7)]
    assert got[0] == expected[0] and got[1] == expected[1]
    assert all(torch.equal(got[2][k], expected[2][k]) for k in expected[2])
    assert expected[0][-1]["kl"] != 0  # it trained (k1 is an estimate: of either sign)


@pytest.mark.slow
def test_bad_vllm_settings_are_one_line_before_anything_loads(tiny, prompts_file, tmp_path, monkeypatch):
    def refused(*extra, needles):
        args = rloo_vllm.Args(model_name_or_path=tiny["policy"], dataset_name=prompts_file, **dict(extra))
        with pytest.raises(UsageError) as e:
            check_args(args)
            check_vllm_args(args, server=args.vllm_mode == "server")
        for needle in needles:
            assert needle in str(e.value)

    refused(("vllm_gpu_memory_utilization", 0.0), needles=["--vllm_gpu_memory_utilization must be in (0, 1]"])
    refused(("vllm_cpu_kv_cache_gib", 0), needles=["--vllm_cpu_kv_cache_gib must be > 0"])
    refused(("vllm_max_model_length", 100), needles=["cannot hold a prompt and its completion (256 + 32)"])
    refused(("vllm_enable_sleep_mode", True), needles=["needs --vllm_mode colocate and a GPU"])
    refused(("importance_sampling_mode", "token_mask"), needles=["weights tokens", "sequence_mask"])
    refused(("importance_sampling_clip_min", 4.0), needles=["0 <= clip_min < clip_max", "clip_min 4.0, clip_max 3.0"])
    refused(
        ("vllm_mode", "server"), ("vllm_server_base_url", "localhost:8000"), needles=["must look like http://host:port"]
    )
    # an OpenAI-style base URL: its /v1/models was a 404 blamed on a server not started
    refused(
        ("vllm_mode", "server"),
        ("vllm_server_base_url", "http://127.0.0.1:8000/v1"),
        needles=["http://127.0.0.1:8000/v1 has a path: give the server's root, http://127.0.0.1:8000"],
    )
    check_vllm_args(
        rloo_vllm.Args(
            model_name_or_path=tiny["policy"], vllm_mode="server", vllm_server_base_url="http://127.0.0.1:8000/"
        ),
        server=True,
    )  # a root with its slash
    # server options in colocate mode were ignored
    refused(("vllm_server_port", 9000), needles=["--vllm_server_port is for a vLLM server and --vllm_mode is colocate"])
    refused(("vllm_server_base_url", "http://localhost:8000"), needles=["--vllm_server_base_url is for a vLLM server"])
    # the environment's KV cache size silently beat the option
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    refused(("vllm_cpu_kv_cache_gib", 2), needles=["VLLM_CPU_KVCACHE_SPACE=4", "--vllm_cpu_kv_cache_gib 2 disagree"])
    check_vllm_args(
        rloo_vllm.Args(model_name_or_path=tiny["policy"], vllm_cpu_kv_cache_gib=4), server=False
    )  # agreeing
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    # a context longer than the model's positions: named as what the user gave (it was "check the --vllm_* options")
    positions = json.load(open(os.path.join(tiny["policy"], "config.json")))["max_position_embeddings"]
    for extra, needles in [
        (["--vllm_max_model_length", 100000], ["--vllm_max_model_length 100000 exceeds the"]),
        (["--max_completion_length", positions], [f"--max_completion_length (256 + {positions}) exceeds"]),
    ]:
        proc = run_rloo(
            "--model_name_or_path",
            tiny["policy"],
            "--dataset_name",
            prompts_file,
            *extra,
            cwd=tmp_path,
            script="rloo_vllm.py",
        )
        check_one_line_error(proc, *needles, f"{positions} positions", "max_position_embeddings")
        assert not (tmp_path / "runs").exists() or not os.listdir(
            tmp_path / "runs"
        )  # the run it did not start leaves nothing


@pytest.mark.slow
def test_an_unreachable_server_is_one_line_and_leaves_nothing(tiny, prompts_file, tmp_path):
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--vllm_mode",
        "server",
        "--vllm_server_port",
        free_port(),
        cwd=tmp_path,
        script="rloo_vllm.py",
    )
    check_one_line_error(
        proc, "does not answer /v1/models", "ConnectionRefusedError", "start the server first", "VLLM_SERVER_DEV_MODE=1"
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_run_whose_server_gets_another_runs_weights_stops_with_one_line(tiny, server, prompts_file, tmp_path):
    """While a run trains, another client pushes other weights to its server (a model of the same architecture, moved
    far from the run's) every 50 ms, as a second run would: the run's check after a rollout that sampled them stops it
    with one line naming the cause, keeping its last update."""
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    perturb(other, seed=7, scale=0.5)
    run = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "rloo_vllm.py"),
            *map(
                str,
                learning_args(
                    tiny,
                    prompts_file,
                    "--total_episodes",
                    32 * 1000,
                    "--save_steps",
                    1,
                    "--run_name",
                    "run",
                    "--vllm_mode",
                    "server",
                    "--vllm_server_base_url",
                    server["url"],
                ),
            ),
        ],
        cwd=tmp_path,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_updates(run, tmp_path / "runs" / "run" / "metrics.jsonl", 1)
    intruder_args = vllm_args(tiny, vllm_mode="server", vllm_server_base_url=server["url"])
    intruder = VLLMServer(intruder_args)
    try:
        deadline = time.time() + 120
        while run.poll() is None and time.time() < deadline:
            intruder.push_weights(other, weights_for_vllm(other, intruder.dtype))
            time.sleep(0.05)
    finally:
        intruder.close()
    _, run.stderr = run.communicate(timeout=60)
    line = check_one_line_error(
        run, "does not sample from the policy", "another run sends weights to the same server", "continue with:"
    )
    newest = max(os.listdir(tmp_path / "runs" / "run" / "checkpoints"), key=lambda c: int(c.split("-")[1]))
    assert line.endswith(f"--resume_from_checkpoint runs/run/checkpoints/{newest}")


@pytest.mark.slow
def test_the_weights_a_killed_run_left_in_shared_memory_are_removed_by_the_next(tiny, server, capsys):
    """A SIGKILLed server-mode run cannot remove its /dev/shm folder (a model-sized file): the next run removes the
    folders of processes that are gone, and only those."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    stale, alive = (
        tempfile.mkdtemp(prefix=f"rloo_vllm_weights_{pid}_", dir="/dev/shm") for pid in (gone.pid, os.getppid())
    )
    for folder in (stale, alive):
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(bytes(3 * 2**20))
    engine = VLLMServer(vllm_args(tiny, vllm_mode="server", vllm_server_base_url=server["url"]))
    try:
        assert not os.path.exists(stale) and os.path.exists(alive)
        assert f"removed {stale} (3 MiB)" in capsys.readouterr().out
        assert os.path.basename(engine.folder.name).startswith(f"rloo_vllm_weights_{os.getpid()}_")
    finally:
        engine.close()
        shutil.rmtree(alive)
    assert not os.path.exists(engine.folder.name)


@pytest.mark.slow
def test_a_server_whose_model_cannot_take_the_policys_weights_is_one_line_before_any_push(
    tiny, server, prompts_file, tmp_path
):
    """A policy of another size: the push would have stopped the server's engine for good ("Worker failed with error
    ''"); both server clients refuse before it, and the server still answers."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny["policy"])
    config.hidden_size, config.intermediate_size, config.head_dim = 64, 128, 32
    LlamaForCausalLM(config).save_pretrained(tmp_path / "smaller")
    AutoTokenizer.from_pretrained(tiny["policy"]).save_pretrained(tmp_path / "smaller")
    for script, extra in [("rloo_vllm.py", ["--vllm_mode", "server"]), ("rloo_multigpu.py", [])]:
        proc = run_rloo(
            "--model_name_or_path",
            tmp_path / "smaller",
            "--dataset_name",
            prompts_file,
            *extra,
            "--vllm_server_base_url",
            server["url"],
            cwd=tmp_path,
            script=script,
        )
        check_one_line_error(
            proc,
            f"serves {tiny['policy']}, whose hidden_size is 128",
            "is 64",
            f"start it with --model {tmp_path / 'smaller'}",
        )
        assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")
    body = {"model": tiny["policy"], "prompt": [1, 2, 3], "max_tokens": 2}
    request = urllib.request.Request(
        server["url"] + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    assert len(json.load(urllib.request.urlopen(request, timeout=60))["choices"]) == 1


@pytest.mark.slow
def test_a_server_started_without_processed_logprobs_is_one_line_before_training(
    tiny, prompts_file, tmp_path, tmp_path_factory
):
    """Its log-probs are not the sampling distribution's (it blamed the model); both server clients say so at once."""
    servers = start_vllm_server(tiny, tmp_path_factory, logprobs_mode="raw_logprobs")
    raw = next(servers)
    try:
        for script, extra in [("rloo_vllm.py", ["--vllm_mode", "server"]), ("rloo_multigpu.py", [])]:
            proc = run_rloo(
                "--model_name_or_path",
                tiny["policy"],
                "--dataset_name",
                prompts_file,
                *extra,
                "--vllm_server_base_url",
                raw["url"],
                cwd=tmp_path,
                script=script,
            )
            check_one_line_error(
                proc,
                f"the vLLM server at {raw['url']} returns log-probs as raw_logprobs",
                "restart it with --logprobs-mode processed_logprobs",
            )
            assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")
    finally:
        servers.close()


def kill_the_server_under_a_run(server, args, tmp_path) -> None:
    """Kill the server (a dying_server) after the rloo_vllm.py run with `args` (a checkpoint every update) has logged 2 updates: the
    run stops with one line that names the server and its newest checkpoint, whose every checkpoint is complete."""
    args[args.index("--save_steps") + 1] = 1
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "rloo_vllm.py"), *map(str, args)],
        cwd=tmp_path,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "runs" / "run" / "metrics.jsonl"
    wait_for_updates(proc, metrics, 2)
    os.killpg(server["process"].pid, signal.SIGKILL)
    server["process"].wait(timeout=60)
    _, stderr = proc.communicate(timeout=120)
    proc.stderr = stderr
    line = check_one_line_error(
        proc, f"the vLLM server at {server['url']}", "continue with:", "--resume_from_checkpoint"
    )
    checkpoints = sorted(os.listdir(tmp_path / "runs" / "run" / "checkpoints"))
    assert checkpoints and all(
        os.path.isdir(tmp_path / "runs" / "run" / "checkpoints" / c / "policy") for c in checkpoints
    )
    assert checkpoints[-1] in line
    with open(metrics) as f:
        assert len([json.loads(row) for row in f]) >= 2


@pytest.mark.slow
def test_a_server_that_dies_mid_run_is_one_line_and_the_run_keeps_its_checkpoint(
    tiny, dying_server, prompts_file, tmp_path
):
    where = ["--vllm_mode", "server", "--vllm_server_base_url", dying_server["url"], "--vllm_server_timeout", 10]
    kill_the_server_under_a_run(dying_server, resume_args(tiny, prompts_file, *where), tmp_path)
