"""--sampler_weights: HF generate samples from a copy of the policy in bfloat16 (auto: where float32 weights train
under --bf16 on CUDA) or float16, refreshed in place after each update; the sampler-trainer gap is logged and the
importance-sampling correction weighs it, as for vLLM's samples. On a CPU, auto keeps the policy's own weights."""

import json
import os

import pytest
import torch

from conftest import read_metrics, run_rloo
from rloo_utils.off_policy import refresh_copy, sampler_dtype, sampler_line, sampling_copy

REWARDS = os.path.join(os.path.dirname(__file__), "reward_fixtures.py")


def test_which_weights_sample():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert sampler_dtype("auto", torch.float32, True, cuda) == torch.bfloat16  # the default on a GPU
    assert sampler_dtype("auto", torch.float32, True, cpu) is None  # every CPU number stays what it was
    assert sampler_dtype("auto", torch.float32, False, cuda) is None  # fp32 compute: fp32 samples
    assert sampler_dtype("auto", torch.bfloat16, True, cuda) is None  # bf16 weights sample themselves
    assert sampler_dtype("auto", torch.float32, True, cuda, lora=True) is None  # memory first: no 2 B/param copy
    assert sampler_dtype("bfloat16", torch.float32, True, cuda, lora=True) == torch.bfloat16  # unless asked
    assert sampler_dtype("policy", torch.float32, True, cuda) is None
    assert sampler_dtype("float16", torch.float32, False, cpu) == torch.float16
    assert sampler_dtype("bfloat16", torch.bfloat16, True, cuda) is None  # a copy in its own dtype is the policy
    assert sampler_line(torch.float32, torch.bfloat16) == (
        "HF generate samples from a bfloat16 copy of the policy's float32 weights, refreshed after each update"
    )
    assert sampler_line(torch.float32, None) == "HF generate samples from the policy's own float32 weights"


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def test_the_copy_is_the_policy_and_a_refresh_writes_in_place(tiny):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    ids = torch.randint(5, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    copy = sampling_copy(policy, torch.float64)  # float64: the copy's forward is the policy's up to fp32 rounding
    assert next(copy.parameters()).dtype == torch.float64 and not any(p.requires_grad for p in copy.parameters())
    torch.testing.assert_close(logits(copy, ids), logits(policy, ids), rtol=1e-5, atol=1e-5)
    addresses = [p.data_ptr() for p in copy.parameters()]
    with torch.no_grad():  # an update
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    assert not torch.allclose(logits(copy, ids), logits(policy, ids), atol=1e-3)
    refresh_copy(copy, policy)
    torch.testing.assert_close(logits(copy, ids), logits(policy, ids), rtol=1e-5, atol=1e-5)
    assert [p.data_ptr() for p in copy.parameters()] == addresses  # a CUDA graph's addresses stay valid

    bf16 = sampling_copy(policy, torch.bfloat16)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight  # a tied model's copy is tied: 2 bytes a parameter
    assert bf16.lm_head.weight is bf16.model.embed_tokens.weight
    assert sum(p.numel() for p in bf16.parameters()) == sum(p.numel() for p in policy.parameters())
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in policy.state_dict().items()}
    assert all(torch.equal(tensor, expected[name]) for name, tensor in bf16.state_dict().items())


def test_a_lora_policy_s_copy_samples_the_merged_adapter(tiny):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    policy = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny["policy"]), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():  # a trained adapter: B != 0
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    ids = torch.randint(5, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    copy = sampling_copy(policy, torch.float64)
    assert not any("lora" in name for name, _ in copy.named_parameters())  # a plain model: no adapter to compute
    with_adapter = logits(policy, ids)
    with policy.disable_adapter():
        without = logits(policy, ids)
    assert not torch.allclose(with_adapter, without, atol=1e-3)  # the adapter matters here
    torch.testing.assert_close(logits(copy, ids), with_adapter, rtol=1e-5, atol=1e-5)


def sampler_run(tiny, prompts_file, cwd, *extra):
    proc = run_rloo(
        *("--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file),
        *("--reward_funcs", f"{REWARDS}:text_length", "--total_episodes", 16, "--per_device_train_batch_size", 8),
        *("--max_completion_length", 12, "--learning_rate", "3e-3", "--run_name", "run", *extra),
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, read_metrics(cwd)


@pytest.mark.slow
def test_a_bfloat16_copy_samples_and_the_gap_is_logged_and_corrected(tiny, prompts_file, tmp_path):
    """2 updates: the copy samples (said in one line), the gap is logged under the vLLM runs' names and is a bfloat16
    rounding's (above 0, well below a token's log-prob), and the correction weighs it; without the correction the gap
    is still logged. On a CPU the default samples from the policy: no sampler metrics."""
    (tmp_path / "copy").mkdir()
    proc, metrics = sampler_run(tiny, prompts_file, tmp_path / "copy", "--sampler_weights", "bfloat16")
    assert "HF generate samples from a bfloat16 copy of the policy's float32 weights" in proc.stdout
    for row in metrics:
        assert 0 < row["sampling/sampling_logp_difference/mean"] < 0.05
        assert row["sampling/sampling_logp_difference/max"] >= row["sampling/sampling_logp_difference/mean"]
        assert 0.5 < row["sampling/importance_sampling_ratio/mean"] < 2.0
        assert row["time/weight_sync"] > 0
    (tmp_path / "uncorrected").mkdir()
    _, uncorrected = sampler_run(
        tiny,
        prompts_file,
        tmp_path / "uncorrected",
        "--sampler_weights",
        "bfloat16",
        "--no_importance_sampling_correction",
    )
    assert all("sampling/importance_sampling_ratio/mean" not in row for row in uncorrected)
    assert all(row["sampling/sampling_logp_difference/mean"] > 0 for row in uncorrected)
    (tmp_path / "default").mkdir()
    proc, default = sampler_run(tiny, prompts_file, tmp_path / "default")
    assert "HF generate samples from the policy's own float32 weights" in proc.stdout
    assert all(not any(name.startswith("sampling/sampling_logp") for name in row) for row in default)
    with open(tmp_path / "copy" / "runs" / "run" / "args.json") as f:
        assert json.load(f)["sampler_weights"] == "bfloat16"


def test_the_other_scripts_refuse_a_copy_in_one_line(tiny):
    """rloo_vllm.py samples with vLLM (its own bfloat16 weights), rloo_multigpu.py from the weights FSDP gathers
    (bfloat16 under --bf16): neither makes a copy, and neither takes the option silently."""
    import dataclasses

    import rloo_multigpu
    import rloo_vllm
    from rloo_utils.errors import UsageError
    from rloo_utils.checks import check_args

    for script, name, value, needle in [
        (rloo_vllm, "sampler_weights", "bfloat16", "is HF generate's, and this run generates with vLLM"),
        (rloo_vllm, "decoding_loop", "own", "is HF generate's, and this run generates with vLLM"),
        (rloo_multigpu, "sampler_weights", "float16", "samples from the weights FSDP gathers"),
    ]:
        args = dataclasses.replace(script.Args(model_name_or_path=tiny["policy"]), **{name: value})
        with pytest.raises(UsageError, match=needle):
            check_args(args)


def test_a_float16_copy_whose_activations_overflow_is_refused_in_one_line(tiny):
    from transformers import AutoModelForCausalLM

    from rloo_utils.errors import UsageError

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    sampling_copy(policy, torch.float16)  # a model whose activations fit: taken
    with torch.no_grad():
        policy.model.embed_tokens.weight.mul_(1e5)  # activations past 65504 (float32 holds them)
    assert torch.isfinite(policy(input_ids=torch.arange(1, 17)[None]).logits).all()
    with pytest.raises(UsageError, match="--sampler_weights float16: the policy's activations pass float16's range"):
        sampling_copy(policy, torch.float16)
    sampling_copy(policy, torch.bfloat16)  # bfloat16 has float32's range
