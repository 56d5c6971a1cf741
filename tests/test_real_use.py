"""Conditions of real use that a CPU can hold: a model saved in bf16 as hub checkpoints are, the real vLLM package's API
built exactly as the scripts build it (also the objects only a GPU run uses), and a fault on one process of two.
"""

import os

import pytest
import torch

from conftest import ROOT, read_metrics, run_rloo

REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")



@pytest.fixture(scope="module")
def bf16_policy(tiny, tmp_path_factory):
    """The tiny policy saved in bfloat16, its config saying so, as most hub checkpoints are."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("bf16") / "policy")
    model = AutoModelForCausalLM.from_pretrained(tiny["policy"]).to(torch.bfloat16)
    model.save_pretrained(path)
    tiny["tokenizer"].save_pretrained(path)
    return path


@pytest.mark.parametrize("script", ["rloo.py", "rloo_vllm.py", "rloo_multigpu.py"])
def test_a_model_saved_in_bf16_trains_in_fp32_and_moves_at_a_small_learning_rate(script, bf16_policy, prompts_file,
                                                                                  tmp_path):
    """At lr 3e-6 an Adam step (~3e-6 per weight) is far below bf16's spacing at |w| ~ 0.02 (~1e-4): trained in the
    checkpoint's bf16, (almost) no weight would move. Loaded in fp32 (--dtype's default), every trained weight moves."""
    from safetensors.torch import load_file

    proc = run_rloo("--model_name_or_path", bf16_policy, "--dataset_name", prompts_file, "--total_episodes", 16,
                    "--per_device_train_batch_size", 8, "--max_completion_length", 8, "--num_sample_generations", 0,
                    "--reward_funcs", f"{REWARDS}:text_length", "--learning_rate", "3e-6", "--save_steps", 2,
                    cwd=tmp_path, script=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_metrics(tmp_path)) == 2
    (run,) = os.listdir(tmp_path / "runs")
    trained = load_file(tmp_path / "runs" / run / "model" / "model.safetensors")
    initial = load_file(os.path.join(bf16_policy, "model.safetensors"))
    assert {t.dtype for t in trained.values()} == {torch.float32}
    name = "model.layers.0.mlp.up_proj.weight"
    moved = (trained[name] != initial[name].float()).float().mean()
    assert moved > 0.9, f"only {moved:.1%} of {name} moved"
    if script != "rloo_multigpu.py":  # (its optimizer state is in sharded DCP files)
        state = torch.load(tmp_path / "runs" / run / "checkpoints" / "checkpoint-2" / "training_state.pt",
                           weights_only=False)["optimizer"]["state"]
        assert {s[k].dtype for s in state.values() for k in ("exp_avg", "exp_avg_sq")} == {torch.float32}
