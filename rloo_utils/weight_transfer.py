"""The policy's weights on their way to a vLLM engine: by vLLM's NCCL weight transfer to a server's workers (this
process the sender of a group with them: the group's rendezvous, the checks of the server's set-up), or as files in
shared memory that the engine reads (the weights, or a LoRA adapter alone); what a push sent, and the GPU around it."""

import contextlib
import os
import re
import shutil
import socket
import tempfile
import types
import urllib.parse
from typing import Optional

import torch

from rloo_utils.errors import UsageError
from rloo_utils.lora import adapter_weights, base_weights, merged_weights, plain_state_dict

NCCL_SERVER_OPTION = """--weight-transfer-config '{"backend": "nccl"}'"""


def uses_nccl(weight_transfer: str) -> bool:
    """Whether a server gets its weights by vLLM's NCCL weight transfer (else from shared memory): weight_transfer
    (--vllm_server_weight_transfer) nccl, or auto from a GPU."""
    return weight_transfer == "nccl" or (weight_transfer == "auto" and torch.cuda.is_available())


def nccl_workers(server_info: dict, url: str) -> int:
    """The number of inference workers of a server started for vLLM's NCCL weight transfer, from its /server_info."""
    config = server_info["vllm_config"]
    if (config.get("weight_transfer_config") or {}).get("backend") != "nccl":
        raise UsageError(
            f"the vLLM server at {url} was not started for NCCL weight transfer: add {NCCL_SERVER_OPTION} "
            "to its command, or use --vllm_server_weight_transfer shared_memory (trainer and server on one "
            "machine)"
        )
    parallel = config["parallel_config"]
    return parallel["world_size"] * parallel["data_parallel_size"]  # tensor x pipeline parallel, times data parallel


def check_gpus_apart(server_info: dict, url: str, workers: int) -> None:
    """NCCL cannot put two ranks of one group on one GPU ("duplicate GPU"): a server on this machine must not use the
    GPU of this process. Its GPUs are the first `workers` of its CUDA_VISIBLE_DEVICES (all, if unset), which
    its /server_info reports; a server on another machine, or devices named in forms that cannot be compared, pass."""
    host = socket.gethostbyname(urllib.parse.urlparse(url).hostname)
    if not torch.cuda.is_available() or not (host.startswith("127.") or host == rendezvous_address(url)[0]):
        return  # no GPU here, or a server on another machine

    def visible(value: Optional[str]) -> list[str]:
        return [d.strip() for d in value.split(",")] if value else [str(i) for i in range(torch.cuda.device_count())]

    server_env = dict(
        line.split("=", 1)
        for line in (server_info.get("system_env") or {}).get("env_vars", "").splitlines()
        if "=" in line
    )
    server_gpus = visible(server_env.get("CUDA_VISIBLE_DEVICES"))[:workers]
    own_gpu = visible(os.environ.get("CUDA_VISIBLE_DEVICES"))[torch.cuda.current_device()]
    if own_gpu in server_gpus:
        raise UsageError(
            f"the vLLM server at {url} runs on GPU {own_gpu}, which this trainer uses too: NCCL cannot join "
            "two processes on one GPU (and both want its memory): start the server on other GPUs "
            "(CUDA_VISIBLE_DEVICES), or use --vllm_mode colocate (rloo_vllm.py) to share one GPU"
        )


def rendezvous_address(url: str) -> tuple[str, int]:
    """This machine's address on the route to url (the server's workers connect back to it) and a free port."""
    parsed = urllib.parse.urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:  # a UDP connect sends nothing: it picks a route
        route.connect((parsed.hostname, parsed.port or 80))
        address = route.getsockname()[0]
    with socket.socket() as probe:
        probe.bind((address, 0))
        return address, probe.getsockname()[1]


def nccl_sender_parts(url: str, timeout: float, workers: int, policy, dtype: Optional[torch.dtype] = None):
    """What vLLM's NCCL trainer-side engine is built from: the init info (this process is the sender, rank 0 of a group
    with the server's workers), the HTTP client of the server's weight-transfer routes, and the weight source, whose
    `weights` are set to the (name, tensor) pairs of each push, its floating-point tensors in `dtype`."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    class PolicyWeights(WeightSource):  # the script's weights_for_vllm (vLLM's ModuleSource drops a tied LM head)
        weights = iter(())

        def metadata(self):  # names, dtypes and shapes only: state_dict's (of sharded tensors too)
            return [
                ParamMeta(k, dtype if dtype is not None and v.is_floating_point() else v.dtype, tuple(v.shape))
                for k, v in plain_state_dict(policy).items()
            ]

        def __iter__(self):
            return ((k, v.detach()) for k, v in self.weights)

    address, port = rendezvous_address(url)
    init_info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=1 + workers, rank=0)
    return init_info, HTTPVLLMWeightSyncClient(url, timeout), PolicyWeights()


def shared_memory_folder() -> tempfile.TemporaryDirectory:
    """Where weights go to a server on this machine: a folder in /dev/shm named by this process's id, removed at the
    end. A run killed with SIGKILL cannot remove its own: the folders of processes that are gone are removed here."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for name in os.listdir(root):
        match = re.fullmatch(r"rloo_vllm_weights_(\d+)_\w+", name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)  # signal 0: only whether the process exists
            continue
        except ProcessLookupError:
            pass  # gone
        except OSError:
            continue  # PermissionError: another user's process, alive
        folder = os.path.join(root, name)
        with contextlib.suppress(OSError):
            size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
            shutil.rmtree(folder)
            print(f"removed {folder} ({size / 2**20:.0f} MiB), the weights a killed run left behind")
    return tempfile.TemporaryDirectory(prefix=f"rloo_vllm_weights_{os.getpid()}_", dir=root)


def write_adapter(policy, pairs, folder: str) -> int:
    """The policy's LoRA adapter as peft saves it, which vLLM's LoRA loads: adapter_config.json (the policy's LoRA
    config) and adapter_model.safetensors (pairs: lora.adapter_weights') in a new folder. Returns the tensors' bytes."""
    from safetensors.torch import save_file

    os.makedirs(folder)
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in pairs}
    policy.peft_config["default"].save_pretrained(folder)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    return sum(v.numel() * v.element_size() for v in tensors.values())


@contextlib.contextmanager
def weight_push():
    """Around a push of the policy's weights to vLLM, on a GPU: the optimizer's kernels done before vLLM reads the
    weights on a stream of its own (vllm/distributed/weight_transfer/packed_tensor.py), and the copies the push
    made (gathered, cast, merged) given back to the GPU after it."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    try:
        yield
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class CountedWeights:
    """(name, tensor) pairs passed on one at a time, the bytes of the tensors added up as they go (what a push sent)."""

    def __init__(self, pairs):
        self.pairs, self.bytes = iter(pairs), 0

    def __iter__(self):
        return self

    def __next__(self):
        name, tensor = next(self.pairs)
        self.bytes += tensor.numel() * tensor.element_size()
        return name, tensor


def weights_for_vllm(policy, dtype: Optional[torch.dtype], gather=lambda t: t):
    """Every tensor of the policy under its checkpoint name, lm_head.weight included when the embeddings are tied
    (without it vLLM would keep its old LM head and sample from a model that is not the policy, silently), a LoRA
    adapter merged into its weights (the trained copy unchanged), in the engine's dtype (bf16 on a GPU: half the bytes
    of fp32). Its items() yields them one tensor at a time; an engine that serves the adapter alone (--vllm_lora_push)
    takes base() once, the weights without it, and then adapter(), its tensors only. gather (rloo_multigpu.py's
    processes.whole): FSDP's shards gathered one tensor at a time, a collective every process goes through while rank 0
    sends them, so that no device holds the whole model, each cast before its gather (half the bytes of fp32 gathered
    and sent); with --fsdp_cpu_offload a shard goes from CPU memory to the GPU to be gathered there (NCCL)."""
    return types.SimpleNamespace(
        items=lambda: merged_weights(policy, gather=gather, dtype=dtype),
        base=lambda: base_weights(policy, gather=gather, dtype=dtype),
        adapter=lambda: adapter_weights(policy, gather=gather, dtype=dtype),
    )
