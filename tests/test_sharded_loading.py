"""rloo_multigpu.py's loading at scale (issue 26): no process holds a whole model. Each builds the model empty (meta
device), shards it and reads only its own slices of the safetensors files; a checkpoint whose names are not the model's
is read by rank 0 alone, which sends each process its shards. The trained model is written shard by shard.

On 2 CPU processes, for checkpoints as the hub has them (bf16, tied or untied embeddings, several files, a reward
model, a vision-language model saved under other names than its own, a mixture of experts whose experts transformers
fuses on load): the shards equal those of the loading
before (from_pretrained whole, then sharded) to the bit, buffers and generation config included, and the saved folder
loads to the weights save_pretrained's folder loads to. The memory this saves is measured by
benchmark/multigpu_memory.py, not here.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from conftest import ROOT, run_env

CHECK = os.path.join(ROOT, "tests", "sharded_loading_check.py")


def tiny_mixtral(path: str) -> str:
    """A tiny Mixtral saved in bf16: its experts are saved one by one, and transformers fuses them into one tensor per
    layer on load, so the files do not hold the model's tensors."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    MixtralForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in f.keys()
    return path


@pytest.fixture(scope="module")
def checks(tiny, tiny_vlm, tmp_path_factory):
    """Every case loaded and saved both ways on 2 processes: {case: [report of rank 0, of rank 1]}, and the folder."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sharded")
    bf16 = str(root / "llama_bf16")
    AutoModelForCausalLM.from_pretrained(tiny["policy"]).to(torch.bfloat16).save_pretrained(bf16)
    tiny["tokenizer"].save_pretrained(bf16)
    untied = str(root / "llama_untied")  # its own LM head, in several files with an index
    model = AutoModelForCausalLM.from_pretrained(tiny["policy"], tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(-2)
    model.to(torch.bfloat16).save_pretrained(untied, max_shard_size="100KB")
    tiny["tokenizer"].save_pretrained(untied)
    cases = [
        {"name": "llama_bf16", "auto_class": "AutoModelForCausalLM", "path": bf16},
        {"name": "llama_untied", "auto_class": "AutoModelForCausalLM", "path": untied, "cpu_offload": True},
        {
            "name": "reward",
            "auto_class": "AutoModelForSequenceClassification",
            "path": tiny["reward"],
            "kwargs": {"num_labels": 1},
        },
        {"name": "llava", "auto_class": "AutoModelForImageTextToText", "path": tiny_vlm["policy"]},
        {
            "name": "mixtral",
            "auto_class": "AutoModelForCausalLM",
            "path": tiny_mixtral(str(root / "mixtral")),
            "tokenizer": bf16,
        },
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            CHECK,
            str(root),
            json.dumps(cases),
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = {}
    for case in cases:
        with open(root / f"{case['name']}.json") as f:
            reports[case["name"]] = json.load(f)
    return reports, root, {c["name"]: c for c in cases}


@pytest.mark.parametrize(
    "name, streamed",
    [("llama_bf16", True), ("llama_untied", True), ("reward", True), ("llava", True), ("mixtral", False)],
)
@pytest.mark.slow
def test_every_process_gets_the_shards_of_the_loading_before(checks, name, streamed):
    reports, _, _ = checks
    for rank, report in enumerate(reports[name]):
        assert report["streamed"] == streamed, rank  # its own slices of the files, or rank 0's copy sent
        assert report["keys_equal"] and report["different_weights"] == [] and report["different_buffers"] == [], report
        assert report["generation_config_equal"] and report["training"] == [False, False]
        assert report["tied"] is None or report["tied"][0] == report["tied"][1]
        assert report["missing_weights"] == []
        assert report["local_numel"] < 0.75 * report["numel"]  # each process holds its shards, not the model
    assert reports["llama_bf16"][0]["tied"] == [True, True] and reports["llama_untied"][0]["tied"] == [False, False]


def tensors_of(folder) -> dict:
    tensors = {}
    for file in os.listdir(folder):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_bf16", "llama_untied", "reward", "llava", "mixtral"])
def test_the_model_saved_shard_by_shard_loads_as_save_pretrained_s(checks, name):
    import transformers

    _, root, cases = checks
    old, new = root / name / "old", root / name / "new"
    assert "sharded" not in os.listdir(new)  # the processes' parts, removed once joined
    assert (new / "model.safetensors").exists() and not (new / "model.safetensors.index.json").exists()
    with open(old / "config.json") as f, open(new / "config.json") as g:
        assert json.load(f) == json.load(g)
    saved_old, saved_new = tensors_of(old), tensors_of(new)
    assert {t.dtype for t in saved_new.values()} == {torch.float32}  # the training dtype, as save_pretrained writes
    assert saved_new.keys() <= saved_old.keys() and saved_old.keys() - saved_new.keys() <= {"lm_head.weight"}
    assert all(torch.equal(saved_new[k], saved_old[k]) for k in saved_new)
    auto_class = getattr(transformers, cases[name]["auto_class"])
    a, b = (auto_class.from_pretrained(folder, **cases[name].get("kwargs", {})).state_dict() for folder in (old, new))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {f for f in os.listdir(new) if not f.startswith(("tokenizer", "chat_template"))} == set(os.listdir(old))


@pytest.mark.slow
def test_a_large_model_is_saved_in_files_of_the_largest_size_given(tiny, tmp_path):
    """save_sharded_model's max_shard_size splits the weights into files and an index, as save_pretrained's does."""
    script = f"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, {ROOT!r})
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, AutoTokenizer
from rloo_utils.processes import end_processes
from rloo_utils.sharded import empty_model, save_sharded_model, shard
dist.init_process_group("gloo")
model = shard(empty_model(AutoModelForCausalLM, {tiny["policy"]!r}, torch.float32), init_device_mesh("cpu", (2,)), False, False)
save_sharded_model({str(tmp_path / "out")!r}, model, AutoTokenizer.from_pretrained({tiny["policy"]!r}), max_shard_size="200KB")
end_processes(0)
"""
    (tmp_path / "save.py").write_text(script)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(tmp_path / "save.py"),
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 2 and files == sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors"))
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(tiny["policy"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dtype_auto_is_the_dtype_from_pretrained_gives(tiny, tmp_path):
    """--dtype auto: the config's dtype, else (a config that names none) that of the first floating-point weight."""
    import shutil

    from transformers import AutoModelForCausalLM

    from rloo_utils.sharded import empty_model

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny["policy"]).to(torch.bfloat16).save_pretrained(bf16)
    unnamed = tmp_path / "unnamed"
    shutil.copytree(bf16, unnamed)
    with open(unnamed / "config.json") as f:
        config = json.load(f)
    config.pop("dtype", None), config.pop("torch_dtype", None)
    with open(unnamed / "config.json", "w") as f:
        json.dump(config, f)
    for folder in (bf16, unnamed, tiny["policy"]):
        expected = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").dtype
        assert empty_model(AutoModelForCausalLM, str(folder), "auto").dtype == expected
    assert empty_model(AutoModelForCausalLM, str(unnamed), "auto").dtype == torch.bfloat16
