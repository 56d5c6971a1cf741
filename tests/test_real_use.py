"""Conditions of real use that a CPU can hold: a model saved in bf16 as hub checkpoints are, the real vLLM package's API
built exactly as the scripts build it (also the objects only a GPU run uses), and a fault on one process of two.
"""

import os

import pytest
import torch

from conftest import ROOT, engine_options_of, keywords_of, read_metrics, run_rloo, run_rloo_vllm_in_process

from rloo_utils.errors import RunError, UsageError  # noqa: E402
from rloo_utils.processes import end_processes  # noqa: E402
from rloo_utils.vllm_sampling import check_engine, sampling_options  # noqa: E402
from rloo_utils.vllm_server import VLLMServer, completion_request  # noqa: E402
from rloo_utils.weight_transfer import NCCL_SERVER_OPTION, check_gpus_apart, nccl_sender_parts  # noqa: E402

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


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "rloo_vllm.py", "rloo_multigpu.py"])
def test_a_model_saved_in_bf16_trains_in_fp32_and_moves_at_a_small_learning_rate(
    script, bf16_policy, prompts_file, tmp_path
):
    """At lr 3e-6 an Adam step (~3e-6 per weight) is far below bf16's spacing at |w| ~ 0.02 (~1e-4): trained in the
    checkpoint's bf16, (almost) no weight would move. Loaded in fp32 (--dtype's default), every trained weight moves."""
    from safetensors.torch import load_file

    proc = run_rloo(
        "--model_name_or_path",
        bf16_policy,
        "--dataset_name",
        prompts_file,
        "--total_episodes",
        16,
        "--per_device_train_batch_size",
        8,
        "--max_completion_length",
        8,
        "--num_sample_generations",
        0,
        "--reward_funcs",
        f"{REWARDS}:text_length",
        "--learning_rate",
        "3e-6",
        "--save_steps",
        2,
        cwd=tmp_path,
        script=script,
    )
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
        state = torch.load(
            tmp_path / "runs" / run / "checkpoints" / "checkpoint-2" / "training_state.pt", weights_only=False
        )["optimizer"]["state"]
        assert {s[k].dtype for s in state.values() for k in ("exp_avg", "exp_avg_sq")} == {torch.float32}


# ---------------------------------------------------------------------------------------------------------------------
# vLLM's API as the scripts use it on a GPU: every object built exactly as the scripts build it, without connecting, so
# that a signature change in vLLM fails here rather than at a user's first GPU run
# ---------------------------------------------------------------------------------------------------------------------
def gpu_args(tiny, **kwargs):
    import rloo_vllm

    return rloo_vllm.Args(model_name_or_path=tiny["policy"], max_prompt_length=32, max_completion_length=16, **kwargs)


def pretend_gpu(monkeypatch, count=2, current=0):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True
    )  # (Args' --bf16 default reads it)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


@pytest.mark.parametrize("hub_offline", [False, True])
def test_the_colocated_engine_arguments_are_vllms(tiny, monkeypatch, hub_offline):
    """What ColocatedVLLM hands vllm.LLM on a GPU (sleep mode, bf16, CUDA graphs) names LLM's and EngineArgs' fields,
    with the hub reachable or not: with HF_HUB_OFFLINE=1 (huggingface_hub reads it once, at its import) EngineArgs
    resolves the model as a local folder or a cached hub id, so the engine is given a real folder of the policy's
    config, as ColocatedVLLM gives it (a made-up path failed there: the suite depended on the shell's environment)."""
    import inspect

    import huggingface_hub
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", hub_offline)
    pretend_gpu(monkeypatch)
    config_folder = tiny["policy"]  # the policy's config.json, as the engine's folder holds it
    options = engine_options_of(gpu_args(tiny, vllm_enable_sleep_mode=True), config_folder, torch.device("cuda", 0))
    assert options["dtype"] == "bfloat16" and options["enable_sleep_mode"] and not options["enforce_eager"]
    inspect.signature(LLM).bind(**options)
    engine_args = EngineArgs(**options)
    assert (engine_args.model, engine_args.dtype, engine_args.logprobs_mode, engine_args.generation_config) == (
        config_folder,
        "bfloat16",
        "processed_logprobs",
        "vllm",
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # and float32 on the CPU, as the training forward
    assert engine_options_of(gpu_args(tiny), config_folder, torch.device("cpu"))["dtype"] == "float32"


@pytest.mark.parametrize("script", ["rloo_vllm", "rloo_multigpu"])
def test_sampling_parameters_and_server_requests_are_vllms(tiny, script):
    import importlib

    from vllm import SamplingParams
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    rloo = importlib.import_module(script)
    args = rloo.Args(model_name_or_path=tiny["policy"], temperature=0.7, top_p=0.9, top_k=20)
    for greedy in (False, True):
        options = sampling_options([2, 3], greedy, **keywords_of(sampling_options, args))
        params = SamplingParams(**options, seed=7, detokenize=False)
        assert params.stop_token_ids == [2, 3] and params.logprobs == 0 and params.ignore_eos
        request = CompletionRequest(**completion_request("model", [5, 6, 7], options, seed=7))
        assert request.prompt == [5, 6, 7] and request.return_token_ids and request.seed == 7
        assert request.to_sampling_params(max_tokens=16, default_sampling_params={}).stop_token_ids == [2, 3]


def test_the_nccl_weight_transfer_is_built_as_vllm_expects(tiny):
    """The trainer side of vLLM's NCCL weight transfer: init info (rank included), client and weight source, the
    engine's constructor, and a source whose tensors match the metadata the server sizes its buffers from (vLLM's own
    check). The NCCL rendezvous itself needs GPUs."""
    import inspect
    import json

    from transformers import AutoModelForCausalLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    init_info, client, source = nccl_sender_parts("http://127.0.0.1:8000", 30.0, 2, policy)
    assert init_info.is_sender and init_info.world_size == 3
    inspect.signature(NCCLTrainerWeightTransferEngine.trainer_init).bind(init_info, client=client, source=source)
    engine = NCCLTrainerWeightTransferEngine(
        client=client, source=source, is_sender=init_info.is_sender, packed=init_info.packed
    )
    source.weights = iter(policy.state_dict().items())
    sent = list(engine._checked_iter(source, source.metadata()))
    assert "lm_head.weight" in dict(sent) and len(sent) == len(policy.state_dict())
    assert WeightTransferConfig(**json.loads(NCCL_SERVER_OPTION.split(None, 1)[1].strip("'"))).backend == "nccl"


# ---------------------------------------------------------------------------------------------------------------------
# rloo_multigpu.py: a fault on one process of two stops both within seconds (not at the collective timeout)
# ---------------------------------------------------------------------------------------------------------------------
class FailingSender:
    """vLLM's NCCL sender whose transfer breaks after two tensors, as a server dying mid-push would make it."""

    def __init__(self, server):
        self.server = server

    def send_weights(self):
        next(self.server.source.weights), next(self.server.source.weights)
        raise RuntimeError("NCCL error: remote process exited")


class ServerFailingOnRank1:
    """A server whose answer reaches rank 0 but not rank 1 (a dropped connection)."""

    def __init__(self, rank):
        self.rank = rank

    def generate(self, prompts, options, seeds):

        if self.rank == 1:
            raise RunError("the vLLM server at http://x does not answer /v1/completions")
        return [([5, 6], [-1.0, -1.0]) for _ in prompts]


def one_of_two_processes(rank: int, scenario: str, policy_path: str, port: int, out: str):
    import datetime
    import json
    import time
    import types

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    import rloo_multigpu as rloo
    from rloo_utils.processes import whole
    from rloo_utils.weight_transfer import weights_for_vllm
    from rloo_utils.sharded import shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=90))
    policy = shard(AutoModelForCausalLM.from_pretrained(policy_path), init_device_mesh("cpu", (2,)), False, False)
    start = time.time()
    try:
        if scenario == "push":
            server = VLLMServer.__new__(VLLMServer)
            server.url, server.nccl, server.dtype = "http://x", True, None
            server.source = types.SimpleNamespace(weights=None)
            server.sender = FailingSender(server)
            server.push_weights(policy, weights_for_vllm(policy, server.dtype, whole))
        else:
            ids, mask = torch.tensor([[1, 2, 3], [0, 4, 5]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
            options = {"max_tokens": 2, "stop_token_ids": []}
            with torch.no_grad():
                check_engine(
                    ServerFailingOnRank1(rank),
                    ids,
                    mask,
                    options,
                    lambda *rollout: rloo.completion_logprobs(policy, *rollout, temperature=1.0),
                )
        outcome = "no error"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"outcome": outcome, "seconds": time.time() - start}, f)
    end_processes(0)  # as the script ends: the interpreter's teardown of gloo's threads may abort a process


@pytest.mark.parametrize(
    "scenario, message",
    [
        ("push", "failed a weight transfer over NCCL (RuntimeError: NCCL error: remote process exited)"),
        ("check", "does not answer /v1/completions (on rank 1)"),
    ],
)
def test_a_fault_on_one_process_stops_both_within_seconds(scenario, message, tiny, tmp_path):
    """push: rank 0's transfer breaks half-way through the gathers, which rank 1 is still in; check: rank 1's request
    fails while rank 0 goes on to the sharded forward. Both processes must raise the one error together, at once."""
    import json

    import torch.multiprocessing as mp

    from conftest import free_port, join_processes

    context = mp.start_processes(
        one_of_two_processes,
        args=(scenario, tiny["policy"], free_port(), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
        join=False,
    )
    join_processes(context, 300)
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            result = json.load(f)
        assert result["outcome"].startswith("RunError") and message in result["outcome"], result
        assert result["seconds"] < 30, result


# ---------------------------------------------------------------------------------------------------------------------
# Shared machines: a server on the trainer's GPU, and a /dev/shm too small for the weights, are one line
# ---------------------------------------------------------------------------------------------------------------------
def server_info(cuda_visible_devices=None) -> dict:
    env = "NCCL_DEBUG=WARN\n" + (f"CUDA_VISIBLE_DEVICES={cuda_visible_devices}\n" if cuda_visible_devices else "")
    return {"vllm_config": {}, "system_env": {"env_vars": env}}


def test_a_server_on_the_trainers_gpu_is_refused(monkeypatch):
    """NCCL fails with "duplicate GPU" when the sender and a server worker share a GPU: refused before anything runs."""
    pretend_gpu(monkeypatch, count=4, current=0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(UsageError, match="runs on GPU 0, which this trainer uses too"):
        check_gpus_apart(server_info(), "http://127.0.0.1:8000", workers=1)  # both see every GPU: both on 0
    check_gpus_apart(server_info("1"), "http://127.0.0.1:8000", workers=1)  # docs/vllm.md's layout
    check_gpus_apart(server_info("2,3"), "http://localhost:8000", workers=2)
    with pytest.raises(UsageError, match="runs on GPU 3"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
        check_gpus_apart(server_info("2,3"), "http://localhost:8000", workers=2)  # tensor parallel over 2 and 3
    monkeypatch.setattr(
        "rloo_utils.weight_transfer.rendezvous_address", lambda url: ("10.0.0.1", 1)
    )  # (this machine's address)
    check_gpus_apart(server_info("3"), "http://10.0.0.2:8000", workers=1)  # another machine
    with pytest.raises(UsageError, match="runs on GPU 3"):
        check_gpus_apart(server_info("3"), "http://10.0.0.1:8000", workers=1)  # this machine, by its address


def test_shared_memory_too_small_for_the_weights_is_one_line(tiny, monkeypatch, tmp_path):
    """Docker gives /dev/shm 64 MB: the push says so and what to do, before writing anything."""
    import collections
    import types

    from rloo_utils.weight_transfer import weights_for_vllm
    from transformers import AutoModelForCausalLM

    server = VLLMServer.__new__(VLLMServer)
    server.url, server.nccl, server.dtype = "http://x", False, None
    server.folder = types.SimpleNamespace(name=str(tmp_path / "weights"))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("rloo_utils.vllm_server.shutil.disk_usage", lambda path: usage(64 * 2**20, 63 * 2**20, 2**20))
    with pytest.raises(UsageError, match=r"has 1 MiB free and the policy's weights take \d+ MiB.*--shm-size"):
        policy = AutoModelForCausalLM.from_pretrained(tiny["policy"])
        server.push_weights(policy, weights_for_vllm(policy, server.dtype))
    assert not (tmp_path / "weights").exists()


class RecordingEngine:
    """A stand-in for rloo_vllm.py's ColocatedVLLM, with the methods the loop calls, that records what the run asks of it
    (and the forwards it is told of), in order. Each completion is the same three tokens, ended by a stop token."""

    def __init__(self, events: list, policy):
        self.events, self.policy, self.dtype, self.last_push_bytes = events, policy, None, 0

    def generate(self, prompts, options, seeds, images=None):
        self.events.append("generate")
        return [([5, 6, options["stop_token_ids"][0]], [-6.0, -6.0, -6.0]) for _ in prompts]

    def sleep(self):
        self.events.append("sleep")

    def push_weights(self, policy, weights):
        self.events.append("push_weights")

    def close(self):
        self.events.append("close")


def test_the_colocated_engine_sleeps_before_the_forwards_of_the_rollout(tiny, prompts_file, tmp_path, monkeypatch):
    """Sleep mode frees the engine's memory (30% of the GPU by default) for the largest no-grad forwards, as TRL does:
    right after generation. rloo_vllm.main runs 2 updates here with a recording engine in the colocated engine's place
    (the CPU build has no sleep mode; the check of the engine's log-probs, which needs vLLM's, is left out): in every
    update the engine sleeps after generating the rollout and before the policy's and the reference's forwards of it."""
    import rloo_utils.packing as packing

    events, engines = [], []
    forward = packing.chunked_completion_logprobs  # --padding_free's

    def recording_forward(model, *args, **kwargs):
        if torch.is_grad_enabled():
            events.append("training forward")
        else:
            events.append("policy forward" if model is engines[0].policy else "reference forward")
        return forward(model, *args, **kwargs)

    def colocated(args, policy, device, processor=None):  # ColocatedVLLM's arguments
        engines.append(RecordingEngine(events, policy))
        return engines[0]

    monkeypatch.setattr(packing, "chunked_completion_logprobs", recording_forward)
    argv = ["--model_name_or_path", tiny["policy"], "--dataset_name", prompts_file, "--total_episodes", "16"]
    argv += ["--per_device_train_batch_size", "8", "--max_completion_length", "8", "--num_sample_generations", "0"]
    argv += ["--reward_funcs", f"{REWARDS}:text_length", "--beta", "0.05"]
    run_rloo_vllm_in_process(monkeypatch, argv, tmp_path, colocated, lambda *args: events.append("check_engine"))
    calls = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]  # a forward in chunks: one call
    rollout = ["generate", "sleep", "policy forward", "reference forward", "training forward", "push_weights"]
    assert calls == ["push_weights", "check_engine", *rollout, *rollout, "close"], events
