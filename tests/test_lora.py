"""LoRA adapters (--use_peft, the real peft): the merged weights equal peft's merge without touching the trained copy;
every script trains the adapter only, against the policy with its adapter disabled; checkpoints hold the adapter and
its optimizer state only and a SIGKILLed run resumes exactly; the output is an adapter folder that peft loads onto the
base in a fresh process, and --save_merged_model a plain model with the same outputs; vLLM samples from the merged
weights (tests/test_vllm.py, server mode); bad LoRA options are one line.
"""

import copy
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, check_one_line_error, read_metrics, run_env, run_rloo, wait_for_updates

from rloo_utils.checkpoints import is_saved_model
from rloo_utils.errors import UsageError
from rloo_utils.lora import add_adapter, merged_weights
from rloo_utils.sharded import empty_model

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")


def wall_clock(metric: str) -> bool:
    return metric in ("eps", "step_time") or metric.startswith(("perf/", "time/"))


def lora_options(**kwargs) -> dict:
    """The values add_adapter takes: the LoRA fields of Args, --seed and the model's path."""
    options = dict(
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_target_modules=["all-linear"],
        lora_modules_to_save=None,
        use_dora=False,
        seed=1,
        model_path="tiny",
    )
    return {**options, **kwargs}


def trained_a_little(model, seed: int = 0) -> None:
    """A stand-in for training: B (zero at the start, so that merging would add nothing) and DoRA's magnitudes move."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)


@pytest.mark.parametrize("dora", [False, True])
def test_merged_weights_are_peft_merge_and_leave_the_trained_copy_unchanged(tiny, dora):
    from transformers import AutoModelForCausalLM

    options = lora_options(use_dora=dora, lora_modules_to_save=["norm"] if dora else None)  # every norm trained in full
    model = add_adapter(AutoModelForCausalLM.from_pretrained(tiny["policy"]), **options)
    trained_a_little(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = dict(merged_weights(model))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not merged in place and back

    expected = copy.deepcopy(model).merge_and_unload().state_dict()  # peft's own merge
    assert merged.keys() == expected.keys() == AutoModelForCausalLM.from_pretrained(tiny["policy"]).state_dict().keys()
    for name in expected:
        torch.testing.assert_close(merged[name], expected[name], rtol=1e-5, atol=1e-6)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
    )  # the adapter is in it
    plain = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    plain.load_state_dict(merged)
    ids = torch.tensor([[1, 5, 9, 30, 200, 7]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_an_adapter_drawn_on_a_model_built_empty_is_the_one_drawn_on_the_loaded_model(tiny):
    """rloo_multigpu.py builds its policy on the meta device: its adapters start where rloo.py's do, whatever the
    process's own random state."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(123)
    loaded = add_adapter(AutoModelForCausalLM.from_pretrained(tiny["policy"]), **lora_options(seed=7))
    torch.manual_seed(456)
    empty = add_adapter(empty_model(AutoModelForCausalLM, tiny["policy"], torch.float32), **lora_options(seed=7))
    adapter = {name: p for name, p in loaded.named_parameters() if ".lora_" in name}
    assert (
        empty.adapter_init.keys() == adapter.keys() and len(adapter) == 2 * 7 * 2
    )  # A and B, 7 linear layers, 2 layers
    assert all(torch.equal(empty.adapter_init[k], adapter[k]) for k in adapter)
    assert all(not p.any() for k, p in adapter.items() if ".lora_B." in k)  # B = 0: the policy starts as the model


def test_dora_on_a_transposed_layer_is_one_line():
    """GPT-2's Conv1D stores its weight (in, out): peft takes it as linear, but DoRA's row norms would be the columns."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(UsageError, match="--use_dora on transformer.h.0.attn.c_attn, a layer that stores"):
        add_adapter(model, **lora_options(lora_target_modules=["c_attn"], use_dora=True))
    adapted = add_adapter(GPT2LMHeadModel(model.config), **lora_options(lora_target_modules=["c_attn"]))
    trained_a_little(adapted)  # plain LoRA on it merges as peft does
    expected = copy.deepcopy(adapted).merge_and_unload().state_dict()
    assert all(torch.allclose(v, expected[k], atol=1e-6) for k, v in merged_weights(adapted))


def base_args(tiny, data, *extra):
    """3 updates of 2 epochs x 2 minibatches with a KL, a sample table and a checkpoint every update."""
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--reward_funcs",
        f"{REWARDS}:text_length",
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
        "3e-3",
        "--beta",
        0.1,
        "--num_sample_generations",
        1,
        "--save_steps",
        1,
        "--run_name",
        "run",
        "--use_peft",
        "--lora_r",
        4,
        "--lora_target_modules",
        "all-linear",
        *extra,
    ]


def logits_in_a_fresh_process(folder: str, base: str, cwd) -> dict:
    """What a user does with the output: peft loads the adapter onto the base model, transformers the merged model."""
    code = f"""
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
ids = torch.tensor([[1, 5, 9, 30, 200, 7]])
base = AutoModelForCausalLM.from_pretrained({base!r})
with torch.no_grad():
    plain = base(ids).logits
    adapted = PeftModel.from_pretrained(base, {folder!r})(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained({os.path.join(folder, "merged")!r})(ids).logits
json.dump({{"adapter_moved": float((adapted - plain).abs().max()), "merged_gap": float((merged - adapted).abs().max())}},
          sys.stdout)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=run_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "rloo_vllm.py", "rloo_multigpu.py"])
def test_every_script_trains_the_adapter_and_saves_what_peft_loads(script, tiny, prompts_file, tmp_path):
    from safetensors.torch import load_file

    proc = run_rloo(
        *base_args(tiny, prompts_file, "--save_merged_model", "--gradient_checkpointing"), cwd=tmp_path, script=script
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert rows[0]["kl"] == 0  # the reference is the policy with its adapter disabled: B = 0 at the start
    assert rows[-1]["kl"] != 0 and rows[0]["optim/grad_norm"] > 0  # the adapter trained (with gradient checkpointing)
    if script == "rloo_vllm.py":  # vLLM sampled from the merged weights, update after update
        assert all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows), rows

    run = tmp_path / "runs" / "run"
    output = run / "model"
    assert is_saved_model(str(output)) and not (output / "model.safetensors").exists()
    adapter = load_file(output / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert any(t.any() for k, t in adapter.items() if ".lora_B." in k)  # B moved away from 0
    # the checkpoints hold the adapter and AdamW's states of the adapter only
    checkpoint = run / "checkpoints" / "checkpoint-3"
    state = torch.load(checkpoint / "training_state.pt", weights_only=False)
    if script == "rloo_multigpu.py":
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(str(checkpoint / "dcp")).read_metadata().state_dict_metadata
        weights = {k for k in saved if k.startswith("model.")}
        assert weights and all(".lora_" in k for k in weights)
        assert {k.split(".state.")[1].rsplit(".", 1)[0] for k in saved if k.startswith("optimizer.state.")} == {
            k[len("model.") :] for k in weights
        }
    else:
        files = set(os.listdir(checkpoint / "policy"))
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files and not any(
            f.startswith("model") for f in files
        )
        moments = [s["exp_avg"].numel() for s in state["optimizer"]["state"].values()]
        assert sum(moments) == sum(t.numel() for t in adapter.values())
    loaded = logits_in_a_fresh_process(str(output), tiny["policy"], tmp_path)
    assert loaded["adapter_moved"] > 1e-3 and loaded["merged_gap"] < 1e-4


@pytest.mark.slow
def test_a_sigkilled_lora_run_resumes_as_the_same_run(tiny, prompts_file, tmp_path):
    from safetensors.torch import load_file

    args = base_args(
        tiny,
        prompts_file,
        "--total_episodes",
        48,
        "--save_steps",
        3,
        "--reward_funcs",
        f"{REWARDS}:slow_text_length",
        "--lora_dropout",
        0.1,
    )
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir(), killed.mkdir()
    proc = run_rloo(*args, cwd=reference)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "rloo.py"), *map(str, args)],
        cwd=killed,
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_updates(proc, killed / "runs" / "run" / "metrics.jsonl", 4)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert sorted(os.listdir(killed / "runs" / "run" / "checkpoints")) == ["checkpoint-3"]
    resumed = run_rloo(*args, "--resume_from_checkpoint", "latest", cwd=killed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    outcome = [
        (
            [{k: v for k, v in r.items() if not wall_clock(k)} for r in read_metrics(folder)],
            (folder / "runs" / "run" / "samples.jsonl").read_text(),
            load_file(folder / "runs" / "run" / "model" / "adapter_model.safetensors"),
        )
        for folder in (reference, killed)
    ]
    assert len(outcome[0][0]) == 6 and outcome[0][0][-1]["kl"] != 0
    assert outcome[1][:2] == outcome[0][:2]  # every metric of every update and the sample tables, exactly
    assert all(torch.equal(outcome[1][2][k], outcome[0][2][k]) for k in outcome[0][2])  # the adapter, bit for bit


@pytest.mark.slow
def test_two_processes_train_the_adapter_of_one_process(tiny, prompts_file, tmp_path):
    """rloo_multigpu.py with a LoRA policy sharded by FSDP2 (frozen base, trained adapters): on 2 processes the run of
    1 process on the same global batch, the adapter and the merged model saved from the shards."""
    from safetensors.torch import load_file
    from test_multigpu import PER_MICRO_BATCH, run_torchrun, same_batch_args

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    lora = [
        "--use_peft",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
        "up_proj",
        "--use_dora",
        "--lora_modules_to_save",
        "norm",
        "--save_merged_model",
    ]
    proc = run_rloo(*same_batch_args(tiny, prompts_file, 16, *lora), cwd=one, script="rloo_multigpu.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a1 = load_file(one / "runs" / "run" / "model" / "adapter_model.safetensors")
    assert any(t.any() for k, t in a1.items() if ".lora_B." in k)  # the adapter trained: B moved away from 0
    proc = run_torchrun(2, *same_batch_args(tiny, prompts_file, 8, *lora), cwd=two)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m1, m2 = read_metrics(one), read_metrics(two)
    assert m1[0]["kl"] == 0 and m1[-1]["kl"] != 0  # (k1: a KL of either sign)
    for a, b in zip(m1, m2):
        for k in {k for k in a if not wall_clock(k)} - PER_MICRO_BATCH:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    a2 = load_file(two / "runs" / "run" / "model" / "adapter_model.safetensors")
    assert a1.keys() == a2.keys() and any("lora_magnitude_vector" in k for k in a1)  # DoRA's magnitudes trained too
    assert any(k.endswith("model.norm.weight") for k in a1)  # and the layers saved in full
    for k in a1:
        torch.testing.assert_close(a2[k], a1[k], rtol=1e-3, atol=1e-4)
    assert logits_in_a_fresh_process(str(two / "runs" / "run" / "model"), tiny["policy"], two)["merged_gap"] < 1e-4


@pytest.mark.parametrize(
    "extra, needles",
    [
        (
            ["--lora_r", 8, "--save_merged_model"],
            ["--lora_r --save_merged_model set up LoRA adapters", "add --use_peft"],
        ),
        (
            ["--use_peft", "--lora_target_modules", "q_projection"],
            ["--lora_target_modules q_projection gives", "no adapter", "q_projection"],
        ),
        (["--use_peft", "--lora_target_modules", "embed_tokens"], ["not linear", "model.embed_tokens (Embedding)"]),
        (["--use_peft", "--lora_dropout", 1.0], ["--lora_dropout must be in [0, 1)"]),
        (["--use_peft", "--lora_modules_to_save", "lm_head"], ["--lora_modules_to_save lm_head: its weight is tied"]),
        (
            ["--use_peft", "--lora_modules_to_save", "norm", "no_such_layer"],  # (norm: peft's suffix match finds them)
            ["--lora_modules_to_save no_such_layer names no layer of", "nothing of it would train"],
        ),
        (["--use_peft", "--lora_target_modules", "q_proj", "lm_head"], ["adapter to lm_head, whose weight is tied"]),
        (["--use_peft", "--reward_model_path", "POLICY"], ["is the policy's own model", "sequence classifier"]),
    ],
)
@pytest.mark.slow
def test_bad_lora_options_are_one_line_and_leave_nothing(extra, needles, tiny, prompts_file, tmp_path):
    extra = [tiny["policy"] if e == "POLICY" else e for e in extra]
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--total_episodes",
        16,
        "--per_device_train_batch_size",
        4,
        *extra,
        cwd=tmp_path,
    )
    check_one_line_error(proc, *needles)
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")  # no run folder left


@pytest.mark.slow
def test_a_sigkilled_lora_run_on_two_processes_resumes_as_the_same_run(tiny, prompts_file, tmp_path):
    """rloo_multigpu.py's checkpoint holds the adapter's shards and their AdamW states; the base is read again."""
    from safetensors.torch import load_file
    from test_multigpu import resume_args, run_torchrun, torchrun, worker_pids

    args = resume_args(tiny, prompts_file, "--use_peft", "--lora_target_modules", "all-linear")
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir(), killed.mkdir()
    proc = run_torchrun(2, *args, cwd=reference)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.Popen(
        [*torchrun(2), *map(str, args)], cwd=killed, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_updates(proc, killed / "runs" / "run" / "metrics.jsonl", 4)
    for pid in worker_pids(proc.pid).values():
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert sorted(os.listdir(killed / "runs" / "run" / "checkpoints"))[-1] == "checkpoint-3"
    resumed = run_torchrun(2, *args, "--resume_from_checkpoint", "latest", cwd=killed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    outcome = [
        (
            [{k: v for k, v in r.items() if not wall_clock(k)} for r in read_metrics(folder)],
            load_file(folder / "runs" / "run" / "model" / "adapter_model.safetensors"),
        )
        for folder in (reference, killed)
    ]
    assert len(outcome[0][0]) == 6 and outcome[1][0] == outcome[0][0]
    assert all(torch.equal(outcome[1][1][k], outcome[0][1][k]) for k in outcome[0][1])


@pytest.mark.slow
def test_a_lora_policy_whose_files_rank_0_reads_whole_trains_on_two_processes(tiny, prompts_file, tmp_path):
    """Where the files are not the model's tensors (Mixtral's experts, fused by transformers on load; the GGUF default)
    rank 0 loads the base whole and sends each process its shards: the frozen weights arrive as they are."""
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM
    from test_multigpu import run_torchrun

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=len(tiny["tokenizer"]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        eos_token_id=tiny["tokenizer"].eos_token_id,
        pad_token_id=tiny["tokenizer"].pad_token_id,
        bos_token_id=tiny["tokenizer"].bos_token_id,
    )
    path = str(tmp_path / "mixtral")
    MixtralForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tiny["tokenizer"].save_pretrained(path)
    proc = run_torchrun(
        2,
        "--model_name_or_path",
        path,
        "--dataset_name",
        prompts_file,
        "--reward_funcs",
        f"{REWARDS}:text_length",
        "--total_episodes",
        32,
        "--per_device_train_batch_size",
        8,
        "--max_completion_length",
        8,
        "--learning_rate",
        "3e-3",
        "--num_sample_generations",
        0,
        "--use_peft",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
        "--save_merged_model",
        "--run_name",
        "run",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert rows[0]["kl"] == 0 and rows[-1]["kl"] != 0
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "run" / "model" / "merged").state_dict()
    assert merged.keys() == base.keys()
    for name in base:  # the experts and every other frozen weight as the files hold them; the adapted ones moved
        assert torch.equal(merged[name], base[name]) != (name.endswith(("q_proj.weight", "v_proj.weight"))), name
