"""Precision: what each script computes in, and what it refuses or stops on.

Under --bf16 every attention of every script computes in bf16 (the engine check's forward too); --dtype float16 is
refused and a float16 checkpoint is trained in float32; an optimizer step that leaves a weight inf/NaN stops the run
without saving those weights; --bf16 is on by default only on a GPU that computes it; frozen linear layers are held in
bf16 under --bf16 and compute what autocast computes from fp32; the CUDA allocator gets expandable segments unless the
user set its options.

The runs that must see inside a script (its attention calls, its optimizer) run through tests/run_patched.py, which
imports a patch module before running the script as __main__.
"""

import copy
import glob
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from conftest import ROOT, check_one_line_error, read_metrics, run_env, run_rloo
from test_multigpu import run_torchrun

import rloo
from rloo_utils import options
from rloo_utils.errors import NonFiniteWeights
from rloo_utils.models import (
    optimizer_step,
    bf16_by_default,
    checkpoint_dtype,
    expandable_segments_by_default,
    frozen_linear_weights_to,
    model_dtype,
    set_up_cuda,
    weights_finite,
)

RUN_PATCHED = os.path.join(ROOT, "tests", "run_patched.py")


def short(tiny, data, *extra):
    """One update of 16 completions."""
    return [
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        data,
        "--total_episodes",
        16,
        "--per_device_train_batch_size",
        16,
        "--max_completion_length",
        8,
        "--num_sample_generations",
        0,
        *extra,
    ]


def run_patched(patch, script, *args, cwd, env=None, processes=1, timeout=600):
    """`script` (rloo.py, ...) run with args after the patch module at path `patch`; on 2 processes through torchrun."""
    if processes == 1:
        return subprocess.run(
            [sys.executable, RUN_PATCHED, str(patch), os.path.join(ROOT, script), *map(str, args)],
            cwd=cwd,
            env={**run_env(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    # run_torchrun launches its SCRIPT (rloo_multigpu.py) with the arguments given: swap it for the wrapper
    import test_multigpu

    launcher = test_multigpu.torchrun
    test_multigpu.torchrun = lambda nproc: [*launcher(nproc)[:-1], RUN_PATCHED, str(patch), os.path.join(ROOT, script)]
    try:
        return run_torchrun(processes, *args, cwd=cwd, env=env, timeout=timeout)
    finally:
        test_multigpu.torchrun = launcher


def saved_weights(folder) -> dict:
    """Every weight of the safetensors files under folder (at least one file), by name; of a sharded checkpoint
    (rloo_multigpu.py's folder/dcp), its model's weights gathered."""
    from safetensors.torch import load_file

    if os.path.isdir(os.path.join(folder, "dcp")):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as gathered:
            dcp_to_torch_save(os.path.join(folder, "dcp"), os.path.join(gathered, "policy.pt"))
            return torch.load(os.path.join(gathered, "policy.pt"))["model"]
    files = glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True)
    assert files, f"no weights under {folder}"
    return {f"{os.path.basename(f)}:{k}": v for f in files for k, v in load_file(f).items()}


# ---- Attention under --bf16 -----------------------------------------------------------------------------------------
# Records, for every call of transformers' sdpa attention, the dtype flash attention would compute in from the same
# arguments (transformers' get_target_dtype: an fp32 query goes to the autocast dtype when autocast is on, else to the
# dtype of the layer's weights: fp32, which flash attention refuses) and the dtype sdpa returned (what it computed in),
# with whether the engine check (check_engine) made the call. The query itself is fp32 under autocast in Llama (the
# rotary embedding's fp32 cos/sin promote the bf16 projections), so it is not what tells a bf16 forward.
ATTENTION_PATCH = """
import os
import traceback

from transformers.integrations.flash_attention import get_target_dtype
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]


def recording(module, query, *args, **kwargs):
    out = sdpa(module, query, *args, **kwargs)
    in_check = any(frame.name == "check_engine" for frame in traceback.extract_stack())
    with open(os.environ["ATTENTION_DTYPES"], "a") as f:
        f.write(f"{get_target_dtype(query, module) or query.dtype} {out[0].dtype} {in_check}\\n")
    return out


AttentionInterface.register("sdpa", recording)
"""


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "rloo_vllm.py", "rloo_multigpu.py"])
def test_every_attention_computes_in_bf16_under_bf16(script, tiny, prompts_file, tmp_path):
    """Policy (generation, rollout, training), reference (--beta), reward model and, for rloo_vllm.py, the forward that
    checks the engine's log-probs (it ran outside autocast: flash attention on a GPU refused its fp32 query). rloo_vllm
    colocates vLLM on the CPU; rloo_multigpu.py runs 2 processes (gloo), generating with the policy."""
    patch, record = tmp_path / "attention_patch.py", tmp_path / "dtypes.txt"
    patch.write_text(ATTENTION_PATCH)
    processes = 2 if script == "rloo_multigpu.py" else 1
    proc = run_patched(
        patch,
        script,
        *short(
            tiny,
            prompts_file,
            "--bf16",
            "--beta",
            0.1,
            "--reward_model_path",
            tiny["reward"],
            "--per_device_train_batch_size",
            16 // processes,
        ),
        cwd=tmp_path,
        env={"ATTENTION_DTYPES": str(record)},
        processes=processes,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(bf16 compute" in " ".join(proc.stdout.split())  # (the console wraps its lines)
    rows = [line.split() for line in record.read_text().splitlines()]
    assert len(rows) > 10, rows  # the attention of every forward went through the patch
    assert all(handed == "torch.bfloat16" and computed == "torch.bfloat16" for handed, computed, _ in rows), rows
    if script == "rloo_vllm.py":  # the engine check's forward was among them
        assert any(in_check == "True" for _, _, in_check in rows), rows


# ---- float16 --------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "rloo_vllm.py", "rloo_multigpu.py"])
def test_dtype_float16_is_one_line_and_leaves_no_run_folder(script, tiny, prompts_file, tmp_path):
    proc = run_rloo(*short(tiny, prompts_file, "--dtype", "float16"), cwd=tmp_path, script=script)
    check_one_line_error(proc, "--dtype float16", "train float32 weights")
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def float16_policy(tiny, tmp_path_factory):
    """The tiny policy saved as a float16 checkpoint (as Pythia, OPT are on the hub)."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("float16") / "policy")
    AutoModelForCausalLM.from_pretrained(tiny["policy"]).to(torch.float16).save_pretrained(path)
    tiny["tokenizer"].save_pretrained(path)
    assert checkpoint_dtype(path) == torch.float16
    assert model_dtype("auto", path) == torch.float32
    assert model_dtype("auto", tiny["policy"]) == "auto"  # (a float32 checkpoint: its own)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_a_float16_checkpoint_with_dtype_auto_trains_in_float32(
    processes, float16_policy, tiny, prompts_file, tmp_path
):
    """rloo.py (from_pretrained) and rloo_multigpu.py on 2 processes (empty_model, then its shards); left to its
    default on the CPU, the run computes in fp32 and says so."""
    args = short(
        {"policy": float16_policy},
        prompts_file,
        "--dtype",
        "auto",
        "--beta",
        0.1,
        "--learning_rate",
        1e-3,
        "--output_dir",
        tmp_path / "out",
        "--per_device_train_batch_size",
        16 // processes,
    )
    proc = run_rloo(*args, cwd=tmp_path) if processes == 1 else run_torchrun(2, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(fp32 compute" in " ".join(proc.stdout.split())
    (row,) = read_metrics(tmp_path)
    assert row["optim/skipped_steps"] == 0
    weights = saved_weights(tmp_path / "out")
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values()), {
        k: w.dtype for k, w in weights.items()
    }
    # it trained: the weights moved from the checkpoint's
    initial = saved_weights(float16_policy)
    assert any(not torch.equal(w, initial[k].float()) for k, w in weights.items() if k in initial)


# ---- Non-finite weights ---------------------------------------------------------------------------------------------
def test_an_optimizer_step_past_the_float32_range_raises():  # (of sharded weights: rloo_multigpu.py's run below)
    layer = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[3.3e38, 1.0]]))  # float32 reaches 3.4e38
    # (Adam's first step is ~lr; a larger lr over its bias correction overflows in the step size itself)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=3e37, weight_decay=0.0)
    loss = -layer(torch.ones(1, 2)).sum()  # finite (-3e38), as its gradient (-1, -1): a step of ~lr pushes 3e38 up
    loss.backward()
    with pytest.raises(NonFiniteWeights, match="lower --learning_rate"):
        optimizer_step(layer, optimizer, 1.0, loss.detach())
    assert not torch.isfinite(layer.weight).all()  # (the step did overflow)
    # a step that stays in range is taken as before
    layer = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    loss = layer(torch.ones(1, 2)).sum()
    loss.backward()
    grad_norm, taken = optimizer_step(layer, optimizer, 1.0, loss.detach())
    assert taken and torch.isfinite(grad_norm) and torch.isfinite(layer.weight).all()


def test_weights_finite():
    assert weights_finite([torch.ones(3), torch.zeros(2, 2)])
    assert not weights_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not weights_finite([torch.tensor([float("-inf")])])


# The second optimizer step writes a NaN into a weight (a step with a finite gradient that goes wrong); of a sharded
# weight, into the local shard of rank 0.
NAN_PATCH = """
import os

import torch

step = torch.optim.AdamW.step
calls = [0]


def poisoned(self, *args, **kwargs):
    out = step(self, *args, **kwargs)
    calls[0] += 1
    if calls[0] == 2 and os.environ.get("RANK", "0") == "0":
        weight = self.param_groups[0]["params"][0]
        with torch.no_grad():
            (weight.to_local() if hasattr(weight, "to_local") else weight).view(-1)[0] = float("nan")
    return out


torch.optim.AdamW.step = poisoned
"""


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "rloo_multigpu.py"])
def test_nan_weights_after_a_step_stop_the_run_and_nothing_of_them_is_saved(script, tiny, prompts_file, tmp_path):
    patch = tmp_path / "nan_patch.py"
    patch.write_text(NAN_PATCH)
    processes = 2 if script == "rloo_multigpu.py" else 1
    proc = run_patched(
        patch,
        script,
        *short(
            tiny,
            prompts_file,
            "--total_episodes",
            48,
            "--save_steps",
            1,
            "--run_name",
            "run",
            "--per_device_train_batch_size",
            16 // processes,
        ),
        cwd=tmp_path,
        processes=processes,
    )
    assert proc.returncode != 0
    # every process finds the same weights broken (one norm over all shards): one line, from rank 0 (torchrun itself
    # then reports the processes' exit codes)
    lines = [line for line in proc.stderr.splitlines() if f"{script}: error:" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    for needle in [
        "inf/NaN weights",
        "nothing of this update was saved",
        "the newest checkpoint is runs/run/checkpoints/checkpoint-1",
    ]:
        assert needle in line, line
    assert "--resume_from_checkpoint runs/run/checkpoints/checkpoint-1" in line
    checkpoints = tmp_path / "runs" / "run" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["checkpoint-1"]  # no checkpoint-2, no tmp-checkpoint-2
    # and no final model of those weights (the output folder holds only the claim the run made at its start)
    assert not glob.glob(str(tmp_path / "runs" / "run" / "model" / "*.safetensors"))
    weights = saved_weights(checkpoints / "checkpoint-1")
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


@pytest.mark.slow
def test_nan_weights_at_the_first_step_save_nothing(tiny, prompts_file, tmp_path):
    """No earlier checkpoint: the line says nothing was saved, and the run's folders are removed."""
    patch = tmp_path / "nan_patch.py"
    patch.write_text(NAN_PATCH.replace("calls[0] == 2", "calls[0] == 1"))
    proc = run_patched(
        patch,
        "rloo.py",
        *short(tiny, prompts_file, "--total_episodes", 32, "--save_steps", 1, "--run_name", "run"),
        cwd=tmp_path,
    )
    check_one_line_error(proc, "inf/NaN weights", "nothing was saved")
    assert not (tmp_path / "runs" / "run").exists()


# ---- bf16 by default on a bf16 GPU, TF32 ----------------------------------------------------------------------------
def test_bf16_is_on_by_default_only_on_a_gpu_that_computes_it(each_script, monkeypatch):
    assert not torch.cuda.is_available()  # (this machine)
    assert bf16_by_default() is False and rloo.Args().bf16 is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # a V100, a T4
    assert bf16_by_default() is False and rloo.Args().bf16 is False
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert bf16_by_default() is True and rloo.Args().bf16 is True
    assert rloo.Args(bf16=False).bf16 is False and rloo.Args().tf32 is True


def test_tf32_is_set_on_a_gpu_only(monkeypatch):
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        set_up_cuda(True)  # no GPU: left alone
        assert matmul.fp32_precision == before
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        set_up_cuda(True)
        assert matmul.fp32_precision == "tf32"
        set_up_cuda(False)
        assert matmul.fp32_precision == "ieee"
    finally:
        matmul.fp32_precision = before


# ---- Frozen linear layers in bf16 -----------------------------------------------------------------------------------
def linear_dtypes(model) -> dict:
    return {name: module.weight.dtype for name, module in model.named_modules() if type(module) is torch.nn.Linear}


def test_frozen_linear_weights_in_bf16_compute_what_autocast_computes_from_fp32(tiny):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"]).eval()
    assert policy.lm_head.weight is policy.model.embed_tokens.weight  # tied
    reference = copy.deepcopy(policy).requires_grad_(False)
    frozen_linear_weights_to(reference, torch.bfloat16)
    dtypes = linear_dtypes(reference)
    assert dtypes.pop("lm_head") == torch.float32  # shared with the embeddings: kept
    assert len(dtypes) == 14 and set(dtypes.values()) == {torch.bfloat16}, dtypes  # 7 per layer
    kept = {n: p.dtype for n, p in reference.named_parameters() if "norm" in n or "embed" in n}
    assert kept and set(kept.values()) == {torch.float32}, kept
    ids = tiny["tokenizer"](["the movie was good and the plot", "a very long film"], return_tensors="pt", padding=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(reference(**ids).logits, policy(**ids).logits)  # to the last bit
    # a trained model (the policy) and dtype None are left as they are
    frozen_linear_weights_to(policy, torch.bfloat16)
    frozen = copy.deepcopy(policy).requires_grad_(False)
    frozen_linear_weights_to(frozen, None)
    assert set(linear_dtypes(policy).values()) == set(linear_dtypes(frozen).values()) == {torch.float32}
    # a reward model: its score head too
    reward = AutoModelForSequenceClassification.from_pretrained(tiny["reward"]).eval().requires_grad_(False)
    frozen_linear_weights_to(reward, torch.bfloat16)
    assert set(linear_dtypes(reward).values()) == {torch.bfloat16}


@pytest.mark.parametrize("use_dora", [False, True])
def test_a_lora_policys_base_layers_in_bf16_but_not_dora_bases(use_dora, tiny):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny["policy"]),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=use_dora),
    )
    frozen_linear_weights_to(model, torch.bfloat16)
    dtypes = linear_dtypes(model)
    adapters = {n: d for n, d in dtypes.items() if ".lora_" in n}
    bases = {n: d for n, d in dtypes.items() if n.endswith("base_layer")}
    others = {n: d for n, d in dtypes.items() if n not in adapters and n not in bases and not n.endswith("lm_head")}
    assert len(adapters) == 8 and set(adapters.values()) == {torch.float32}  # trained: fp32
    assert len(bases) == 4 and set(bases.values()) == {torch.float32 if use_dora else torch.bfloat16}, bases
    assert len(others) == 10 and set(others.values()) == {torch.bfloat16}  # frozen, not adapted (k, o, mlp)
    base = model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight and base.lm_head.weight.dtype == torch.float32  # tied
    if use_dora:
        magnitudes = [p for n, p in model.named_parameters() if "lora_magnitude_vector" in n]
        assert magnitudes and all(p.dtype == torch.float32 for p in magnitudes)


@pytest.mark.slow
def test_a_lora_run_under_bf16_has_kl_zero_at_its_first_update(tiny, prompts_file, tmp_path):
    """The reference is the policy with its adapter disabled, its base in bf16: what the policy computes before its
    first step (at the update's rollout, lora_B is 0)."""
    proc = run_rloo(
        *short(
            tiny,
            prompts_file,
            "--use_peft",
            "--bf16",
            "--beta",
            0.1,
            "--learning_rate",
            1e-9,
            "--reward_model_path",
            tiny["reward"],
        ),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_metrics(tmp_path)
    assert row["kl"] == 0 and row["objective/kl"] == 0 and row["objective/non_score_reward"] == 0


# ---- Expandable segments --------------------------------------------------------------------------------------------
ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


@pytest.fixture
def no_alloc_conf(monkeypatch):
    for name in ALLOC_VARS:  # (setenv first: the variables are restored, or removed, after the test)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_expandable_segments_on_a_gpu_by_default(no_alloc_conf):
    no_alloc_conf.setattr(torch.cuda, "is_available", lambda: True)
    expandable_segments_by_default()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in os.environ


@pytest.mark.parametrize("name", ALLOC_VARS)
def test_the_users_allocator_options_are_left_alone(name, no_alloc_conf):
    no_alloc_conf.setattr(torch.cuda, "is_available", lambda: True)
    no_alloc_conf.setenv(name, "expandable_segments:False")
    expandable_segments_by_default()
    assert os.environ[name] == "expandable_segments:False"
    assert {n: os.environ.get(n) for n in ALLOC_VARS if n != name} == {n: None for n in ALLOC_VARS if n != name}


def test_no_allocator_options_without_a_gpu(no_alloc_conf):
    no_alloc_conf.setattr(torch.cuda, "is_available", lambda: False)
    expandable_segments_by_default()
    assert all(n not in os.environ for n in ALLOC_VARS)


def test_importing_rloo_utils_sets_nothing_even_on_a_gpu():
    """Nothing is done when a module is imported: rloo_utils.models, which every script imports, leaves the allocator's
    variables alone on a GPU too (a script's set-up sets them, below)."""
    code = (
        "import os, torch; torch.cuda.is_available = lambda: True; import rloo_utils.models; "
        "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    )
    env = {k: v for k, v in run_env().items() if k not in ALLOC_VARS}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "None"


def test_a_script_sets_expandable_segments_before_its_args_start_cuda(each_script, no_alloc_conf):
    """The allocator reads its variables once, when CUDA starts, and parse_args starts it before main() runs: --bf16's
    default (bf16_by_default) asks whether the GPU computes bf16. The variable is set by then."""
    seen = []

    def is_bf16_supported(*args, **kwargs):
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        return True

    no_alloc_conf.setattr(torch.cuda, "is_available", lambda: True)
    no_alloc_conf.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    no_alloc_conf.setattr(sys, "argv", [f"{each_script.__name__}.py"])
    assert options.parse_args(each_script.Args).bf16
    assert seen and set(seen) == {"expandable_segments:True"}


def test_set_up_cuda_sets_expandable_segments_for_args_made_without_the_bf16_default(no_alloc_conf):
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    try:
        no_alloc_conf.setattr(torch.cuda, "is_available", lambda: True)
        set_up_cuda(True)
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    finally:
        matmul.fp32_precision, conv.fp32_precision = before
