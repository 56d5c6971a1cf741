"""LoRA adapters served to vLLM without merging (--vllm_lora_push, docs/lora.md): the base weights go once, then the
adapter alone after every update, which vLLM's LoRA serves on them. With the real vLLM (its CPU build serves LoRA):
the engine's log-probs are the trainer's, colocated and on a server; a push sends the adapter's bytes, not the model's;
the server loads adapters and reloads its weights once; where vLLM cannot serve the adapter, auto pushes the merged
weights and says why in one line, and `adapter` is refused in one line.
"""

import dataclasses
import os
import re

import pytest
import torch

from conftest import ROOT, check_one_line_error, keywords_of, read_metrics, run_rloo

import rloo_multigpu
import rloo_vllm
from rloo_utils.errors import UsageError
from rloo_utils.lora import add_adapter, adapter_weights, base_weights, merged_weights
from rloo_utils.generation import tokenize_prompts
from rloo_utils.vllm_colocated import ColocatedVLLM
from rloo_utils.vllm_options import adapter_problem, check_vllm_args, choose_lora_push
from rloo_utils.vllm_sampling import pad_completions, sampling_options, unpadded
from rloo_utils.vllm_server import VLLMServer
from rloo_utils.weight_transfer import weights_for_vllm, write_adapter

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")
PROMPTS = ["the movie was", "a very long film and", "it is"]
FALLBACK = "not the adapter alone"  # the line auto prints where it pushes the merged weights


def lora_args(tiny, **kwargs) -> rloo_vllm.Args:
    options = dict(use_peft=True, lora_target_modules=["all-linear"], max_prompt_length=32, max_completion_length=16)
    return rloo_vllm.Args(model_name_or_path=tiny["policy"], **{**options, **kwargs})


def lora_policy(path: str, args):
    from transformers import AutoModelForCausalLM

    return lora_policy_of(AutoModelForCausalLM, path, args)


def lora_policy_of(auto_class, path: str, args):
    return add_adapter(auto_class.from_pretrained(path), **keywords_of(add_adapter, args, model_path=path))


def trained_a_little(policy, seed: int) -> None:
    """A stand-in for an update: the adapters move (B is 0 at the start)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.2)


def untied_model(tmp_path) -> str:
    """The tiny Llama with an LM head of its own (not tied to the embeddings): a layer an adapter may be given, which
    vLLM's LoRA does not cover."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16
    )
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "untied")
    return str(tmp_path / "untied")


def bytes_of(pairs) -> int:
    return sum(t.numel() * t.element_size() for _, t in pairs)


# What a push of the tiny policy sends, counted apart from the code's pairs: the engines here hold fp32 (a CPU engine's
# auto, the test servers' --dtype float32). The adapter of lora_run (all-linear, rank 16) by hand: 16 x (inputs +
# outputs) values a layer, q k v o 128 + 128 each, gate and up 128 + 256, down 256 + 128, on 2 layers (docs/lora.md's
# table: 278,528 bytes).
PUSHED_BYTES_PER_VALUE = torch.float32.itemsize
ALL_LINEAR_ADAPTER_BYTES = 2 * 16 * (4 * (128 + 128) + 3 * (128 + 256)) * PUSHED_BYTES_PER_VALUE


def adapter_bytes_of(policy) -> int:
    """The adapter's bytes as pushed, from peft's own state dict of it (what its save_pretrained writes)."""
    from peft import get_peft_model_state_dict

    return sum(t.numel() for t in get_peft_model_state_dict(policy).values()) * PUSHED_BYTES_PER_VALUE


def base_bytes_of(model_path: str) -> int:
    """The base weights' bytes as pushed, from the model loaded without an adapter: its state dict, the tied LM head a
    tensor of its own (vLLM must get it)."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    assert "lm_head.weight" in state
    return sum(t.numel() for t in state.values()) * PUSHED_BYTES_PER_VALUE


def saved_adapter_bytes(run_root) -> int:
    """The bytes of the adapter the run under run_root saved (peft's adapter_model.safetensors), as pushed."""
    from safetensors.torch import load_file

    (run,) = os.listdir(os.path.join(run_root, "runs"))
    saved = load_file(os.path.join(run_root, "runs", run, "model", "adapter_model.safetensors"))
    return sum(t.numel() for t in saved.values()) * PUSHED_BYTES_PER_VALUE


def check_adapter_pushes(rows, run_root) -> None:
    """Every update's push (logged after it) sent the adapter alone: its bytes are those of the saved adapter, which
    are the hand count's; the merged weights would be 1,722,880 bytes, the base + adapter of a first push 2,001,408."""
    adapter = saved_adapter_bytes(run_root)
    assert adapter == ALL_LINEAR_ADAPTER_BYTES
    assert [r["perf/weight_sync_bytes"] for r in rows] == [adapter] * len(rows)


def gap_to_the_trainer(engine, policy, tokenizer, args) -> float:
    """max |log pi_vllm - log pi_trainer| over sampled tokens at temperature 0.7 (seeded completions of PROMPTS)."""
    prompt_ids, prompt_mask, _, _ = tokenize_prompts(tokenizer, PROMPTS, 32, torch.device("cpu"))
    options = sampling_options([], greedy=False, **keywords_of(sampling_options, args, temperature=0.7))
    outputs = engine.generate(unpadded(prompt_ids, prompt_mask), options, [1, 2, 3])
    completion_ids, sampling_logprobs = pad_completions(outputs, 16, 0, [], torch.device("cpu"))
    with torch.no_grad():
        trainer = rloo_vllm.completion_logprobs(
            policy, prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids), 0.7
        )
    return float((trainer - sampling_logprobs).abs().max())


# ---- Without vLLM: the adapter's files, and which push a run gets ----------------------------------------------------
def test_the_adapter_pushed_is_the_one_peft_saves_and_loads(tiny, tmp_path):
    """adapter_weights names and holds what peft's save_pretrained writes, and write_adapter's folder loads in peft as
    the policy itself; the base weights are the model's without its adapters, lm_head included (tied)."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    args = lora_args(tiny)
    policy = lora_policy(tiny["policy"], args)
    trained_a_little(policy, seed=0)
    saved = get_peft_model_state_dict(policy)
    pushed = dict(adapter_weights(policy))
    assert pushed.keys() == saved.keys() and all(torch.equal(pushed[k], saved[k]) for k in saved)
    written = write_adapter(policy, pushed.items(), str(tmp_path / "adapter"))
    assert written == bytes_of(pushed.items()) > 0  # the file: these bytes and a short header
    assert 0 < os.path.getsize(tmp_path / "adapter" / "adapter_model.safetensors") - written < 10_000
    assert load_file(tmp_path / "adapter" / "adapter_model.safetensors").keys() == saved.keys()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny["policy"]), str(tmp_path / "adapter"))
    ids = torch.tensor([[1, 5, 9, 30, 200, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, policy(input_ids=ids).logits)
    base = dict(base_weights(policy))
    plain = AutoModelForCausalLM.from_pretrained(tiny["policy"]).state_dict()
    assert base.keys() == plain.keys() and "lm_head.weight" in base
    assert all(torch.equal(base[k], plain[k]) for k in plain)
    # what a push sends: the adapter, a small share of the merged weights (all of the model)
    assert bytes_of(pushed.items()) < bytes_of(merged_weights(policy)) / 5


def untied_lm_head_policy(tmp_path):
    args = lora_args({"policy": untied_model(tmp_path)}, lora_target_modules=["q_proj", "lm_head"])
    return args, lora_policy(args.model_name_or_path, args)


@pytest.mark.parametrize("case", ["dora", "lm_head", "modules_to_save"])
def test_auto_pushes_the_merged_weights_saying_why_in_one_line_and_adapter_is_refused(case, tiny, tmp_path, capsys):
    """Where vLLM's LoRA cannot serve the adapter (DoRA, an adapter on the output layer, layers trained in full), auto
    falls back to the merged push with one printed line, and --vllm_lora_push adapter is refused in one line."""
    if case == "lm_head":
        args, policy = untied_lm_head_policy(tmp_path)
        needle = "lm_head"
    else:
        extra = {"use_dora": True} if case == "dora" else {"lora_modules_to_save": ["q_proj"]}
        args = lora_args(tiny, **extra)
        policy = lora_policy(tiny["policy"], args) if case == "dora" else None
        needle = "--use_dora" if case == "dora" else "--lora_modules_to_save q_proj"
    problem = adapter_problem(args.lora_options(), args.model_name_or_path, policy)
    assert problem is not None and needle in problem[0]
    assert choose_lora_push("auto", problem) is False
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and FALLBACK in printed[0] and needle in printed[0], printed
    with pytest.raises(UsageError) as refused:
        choose_lora_push("adapter", problem)
    assert (
        "\n" not in str(refused.value)
        and needle in str(refused.value)
        and "--vllm_lora_push merged" in str(refused.value)
    )
    assert choose_lora_push("merged", problem) is False and capsys.readouterr().out == ""


def test_an_adapter_vllm_serves_gets_the_adapter_push(tiny, tmp_path, capsys):
    """The default LoRA settings (peft's q_proj v_proj, rank 16) and all-linear: no problem, the adapter push."""
    for targets in (None, ["all-linear"]):
        args = lora_args(tiny, lora_target_modules=targets)
        assert adapter_problem(args.lora_options(), args.model_name_or_path, lora_policy(tiny["policy"], args)) is None
        assert choose_lora_push("auto", None) is True and choose_lora_push("adapter", None) is True
    args, policy = untied_lm_head_policy(tmp_path)
    args = dataclasses.replace(args, lora_target_modules=["q_proj", "o_proj", "down_proj"])
    assert (
        adapter_problem(args.lora_options(), args.model_name_or_path, lora_policy(args.model_name_or_path, args))
        is None
    )  # the untied head left alone
    assert capsys.readouterr().out == ""


def test_a_vision_language_policy_gets_the_merged_push(tiny_vlm):
    """vLLM's LoRA on a VLM (its vision tower's adapters) is not checked here: auto pushes the merged weights."""
    from transformers import AutoModelForImageTextToText

    args = lora_args({"policy": tiny_vlm["policy"]}, lora_target_modules=["q_proj", "v_proj"])
    problem = adapter_problem(
        args.lora_options(),
        args.model_name_or_path,
        lora_policy_of(AutoModelForImageTextToText, tiny_vlm["policy"], args),
    )
    assert problem is not None and "vision-language model" in problem[0]


def test_vllm_lora_push_is_refused_in_one_line_where_it_cannot_apply(tiny):
    """Before anything loads: --vllm_lora_push without --use_peft; without vLLM (rloo_multigpu.py with HF generate);
    adapter with options vLLM's LoRA cannot serve (DoRA, a rank above vLLM's largest)."""
    cases = [
        (rloo_vllm.Args(vllm_lora_push="adapter"), False, "add --use_peft"),
        (rloo_multigpu.Args(use_peft=True, vllm_lora_push="merged"), False, "give --vllm_server_host"),
        (rloo_vllm.Args(use_peft=True, use_dora=True, vllm_lora_push="adapter"), False, "leave out --use_dora"),
        (rloo_vllm.Args(use_peft=True, lora_r=1024, vllm_lora_push="adapter"), True, "--lora_r 1024"),
    ]
    for args, server, needle in cases:
        with pytest.raises(UsageError, match=re.escape(needle)) as refused:
            check_vllm_args(args, server=server)
        assert "\n" not in str(refused.value)
    check_vllm_args(rloo_vllm.Args(use_peft=True, use_dora=True), server=False)  # auto: the merged push, no refusal


def recording_server(url: str = "http://127.0.0.1:8000") -> VLLMServer:
    """A VLLMServer without a server, for its LoRA check: lora_problem reads what /server_info answered."""
    server = VLLMServer.__new__(VLLMServer)
    server.url, server.nccl = url, False
    return server


@pytest.mark.parametrize(
    "lora_config, runtime, rank, needle",
    [
        (None, True, 16, "started without --enable-lora"),
        ({"max_lora_rank": 16}, False, 16, "cannot load adapters while it runs"),
        ({"max_lora_rank": 16}, True, 20, "--max-lora-rank 16"),
        ({"max_lora_rank": 32}, True, 20, None),
    ],
)
def test_a_server_that_cannot_load_the_adapter_is_told_from_its_server_info(lora_config, runtime, rank, needle):
    """/server_info says whether a server was started with --enable-lora (its lora_config), runtime loading
    (VLLM_ALLOW_RUNTIME_LORA_UPDATING in vLLM's environment) and its --max-lora-rank; the fix names all three."""
    info = {"vllm_config": {"lora_config": lora_config}, "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": runtime}}
    problem = recording_server().lora_problem(info, rank)
    if needle is None:
        assert problem is None
    else:
        what, fix = problem
        assert needle in what
        served_rank = 16 if rank <= 16 else 32  # the least of vLLM's ranks that holds --lora_r
        assert f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-lora-rank {served_rank}" in fix


# ---- With vLLM: an engine in this process, a server, the scripts -----------------------------------------------------
@pytest.mark.slow
def test_the_colocated_engine_serves_the_pushed_adapter_and_sends_only_it(tiny):
    """The first push sends the base weights and the adapter, every later one the adapter alone (a fraction of the
    merged bytes); after each push vLLM's log-probs are the trainer's, and an update shows only once pushed (a new
    adapter id each time: vLLM would serve its cached old adapter under the old one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
    args = lora_args(tiny)
    policy = lora_policy(tiny["policy"], args)
    engine = ColocatedVLLM(args, policy, torch.device("cpu"))
    try:
        assert engine.adapter
        base, adapter = base_bytes_of(tiny["policy"]), adapter_bytes_of(policy)
        assert adapter == ALL_LINEAR_ADAPTER_BYTES
        for update in range(3):
            engine.push_weights(policy, weights_for_vllm(policy, engine.dtype))
            assert engine.last_push_bytes == (base + adapter if update == 0 else adapter)
            assert gap_to_the_trainer(engine, policy, tokenizer, args) < 1e-4
            trained_a_little(policy, seed=update)
            assert gap_to_the_trainer(engine, policy, tokenizer, args) > 0.1  # not pushed yet
        assert adapter < base / 5
    finally:
        engine.close()


def server_requests(log_path, start: int) -> tuple[int, int]:
    """(reloads of the whole weights, adapter loads) the server logged after offset `start` of its log."""
    with open(log_path) as f:
        f.seek(start)
        text = f.read()
    return text.count('"POST /collective_rpc HTTP'), text.count('"POST /v1/load_lora_adapter HTTP')


@pytest.mark.slow
def test_the_server_serves_the_pushed_adapter_and_sends_only_it(tiny, lora_server):
    """On a server started for runtime LoRA: one reload of the base weights, then an adapter load per push, each under
    a new name the completions name; the log-probs are the trainer's after each push."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
    args = lora_args(tiny, vllm_mode="server", vllm_server_base_url=lora_server["url"])
    policy = lora_policy(tiny["policy"], args)
    start = os.path.getsize(lora_server["log"])
    engine = VLLMServer(args)
    try:
        assert engine.adapter
        base, adapter = base_bytes_of(tiny["policy"]), adapter_bytes_of(policy)
        assert adapter == ALL_LINEAR_ADAPTER_BYTES
        names = []
        for update in range(3):
            engine.push_weights(policy, weights_for_vllm(policy, engine.dtype))
            assert engine.last_push_bytes == (base + adapter if update == 0 else adapter)
            names.append(engine.adapter_name)
            assert gap_to_the_trainer(engine, policy, tokenizer, args) < 1e-4
            trained_a_little(policy, seed=update)
        assert len(set(names)) == 3
    finally:
        engine.close()
    assert server_requests(lora_server["log"], start) == (1, 3)


def lora_run(tiny, prompts_file, *extra, episodes: int = 96, batch: int = 32) -> list:
    return [
        *("--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--total_episodes", episodes),
        *("--reward_funcs", f"{REWARDS}:text_length", "--per_device_train_batch_size", batch),
        *("--max_completion_length", 8, "--learning_rate", "3e-3", "--num_sample_generations", 0),
        *("--use_peft", "--lora_target_modules", "all-linear", *extra),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo_vllm.py", "rloo_multigpu.py"])
def test_a_lora_run_samples_from_the_adapter_on_the_server(script, tiny, lora_server, prompts_file, tmp_path):
    """A run on a server started for runtime LoRA samples from base + adapter: the server's log-probs are the
    trainer's after every update, while the adapter moves the policy away from the base; the server reloaded the whole
    weights once (the base, at the first push) and loaded an adapter at every push. Without the adapter push it would
    reload the weights at every push and load no adapter."""
    where = (
        "--vllm_server_base_url",
        lora_server["url"],
        *(("--vllm_mode", "server") if script == "rloo_vllm.py" else ()),
    )
    start = os.path.getsize(lora_server["log"])
    proc = run_rloo(*lora_run(tiny, prompts_file, *where), cwd=tmp_path, script=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert FALLBACK not in proc.stdout
    rows = read_metrics(tmp_path)
    assert len(rows) == 3 and all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows), rows
    assert rows[-1]["kl"] != 0  # the adapter moved the policy away from its reference, the base
    assert server_requests(lora_server["log"], start) == (1, 1 + len(rows))  # the first push's adapter, one an update
    check_adapter_pushes(rows, tmp_path)


@pytest.mark.slow
def test_a_colocated_lora_run_samples_from_the_adapter(tiny, prompts_file, tmp_path):
    """The colocated engine's log-probs are the trainer's after every update, and every push after the first sent the
    adapter alone (a run that pushed the merged weights samples the same policy: only its bytes tell)."""
    proc = run_rloo(*lora_run(tiny, prompts_file, "--vllm_lora_push", "adapter"), cwd=tmp_path, script="rloo_vllm.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 3 and all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows), rows
    assert rows[-1]["kl"] != 0
    check_adapter_pushes(rows, tmp_path)


@pytest.mark.slow
def test_a_server_without_runtime_lora_gets_the_merged_push_or_refuses_adapter(tiny, server, prompts_file, tmp_path):
    """The shared server was started without --enable-lora: `adapter` is refused in one line before anything loads,
    naming the fix; auto says in one line that it pushes the merged weights, and samples from them."""
    where = ("--vllm_mode", "server", "--vllm_server_base_url", server["url"])
    proc = run_rloo(
        *lora_run(tiny, prompts_file, *where, "--vllm_lora_push", "adapter"), cwd=tmp_path, script="rloo_vllm.py"
    )
    check_one_line_error(proc, "--vllm_lora_push adapter", "without --enable-lora", "--max-lora-rank 16")
    assert not os.path.exists(tmp_path / "runs")
    proc = run_rloo(*lora_run(tiny, prompts_file, *where, episodes=32), cwd=tmp_path, script="rloo_vllm.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if FALLBACK in line]
    assert len(lines) == 1 and "without --enable-lora" in lines[0], proc.stdout[-2000:]
    (row,) = read_metrics(tmp_path)
    assert row["sampling/sampling_logp_difference/max"] < 1e-3


@pytest.mark.slow
def test_two_processes_push_the_gathered_adapter_to_the_server(tiny, lora_server, prompts_file, tmp_path):
    """rloo_multigpu.py under torchrun: the base weights and then the adapter gathered from both processes' shards (a
    collective each goes through), loaded once per push by rank 0 and named by both in their requests."""
    from test_multigpu import run_torchrun

    start = os.path.getsize(lora_server["log"])
    run = lora_run(tiny, prompts_file, "--vllm_server_base_url", lora_server["url"], episodes=64, batch=16)
    proc = run_torchrun(2, *run, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 2 and all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows), rows
    assert server_requests(lora_server["log"], start) == (1, 1 + len(rows))
    check_adapter_pushes(rows, tmp_path)  # the whole adapter gathered, not rank 0's shard
