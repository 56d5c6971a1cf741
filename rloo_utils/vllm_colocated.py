"""A vLLM engine in the training process (rloo_vllm.py's --vllm_mode colocate, TRL's vllm_mode="colocate"): the
arguments it is started with, its start from the policy's config, and ColocatedVLLM, which generates and takes the
policy's weights (or its LoRA adapter alone) after every update."""

import json
import logging
import os
import shutil
import tempfile
from typing import Optional

import torch

from rloo_utils.data import row_images
from rloo_utils.errors import UsageError
from rloo_utils.vllm_options import adapter_problem, choose_lora_push, vllm_lora_rank
from rloo_utils.weight_transfer import CountedWeights, shared_memory_folder, weight_push, write_adapter


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


def engine_dtype(requested: str) -> str:
    """The dtype vLLM holds the weights in: requested (--vllm_dtype), where auto is bfloat16 on a GPU, else float32."""
    return requested if requested != "auto" else "bfloat16" if torch.cuda.is_available() else "float32"


def engine_options(
    config_folder: str,
    device,
    multimodal: bool = False,
    lora_rank: Optional[int] = None,
    *,
    seed: int,
    dtype: str,
    trust_remote_code: bool,
    max_model_len: int,
    gpu_memory_utilization: float,
    enforce_eager: bool,
    enable_sleep_mode: bool,
) -> dict:
    """vllm.LLM's arguments for the colocated engine: the policy's architecture with placeholder weights (the policy's
    are pushed), vLLM's tokenizer and generation defaults off, log-probs after temperature. lora_rank: adapters up to
    this rank are served (one at a time: the policy's latest), else none. The others are LLM's own: seed (--seed),
    dtype (engine_dtype's), trust_remote_code (--trust_remote_code), max_model_len (engine_max_model_len's),
    gpu_memory_utilization, enforce_eager (always on a CPU) and enable_sleep_mode (the --vllm_* options of those
    names)."""
    return dict(
        model=config_folder,
        load_format="dummy",
        skip_tokenizer_init=not multimodal,  # a VLM's images: its processor
        seed=seed,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        generation_config="vllm",
        logprobs_mode="processed_logprobs",
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager or device.type == "cpu",
        enable_sleep_mode=enable_sleep_mode,
        **(cpu_scheduling(max_model_len) if device.type == "cpu" else {}),
        **(dict(enable_lora=True, max_lora_rank=lora_rank, max_loras=1) if lora_rank is not None else {}),
    )


def engine_max_model_len(
    *, vllm_max_model_length: Optional[int], max_prompt_length: int, max_completion_length: int
) -> int:
    """The colocated engine's context: vllm_max_model_length (--vllm_max_model_length), else a prompt and its
    completion."""
    return vllm_max_model_length or max_prompt_length + max_completion_length


def cpu_scheduling(max_model_len: int) -> dict:
    """No chunked prefill on CPU: vLLM 0.32's CPU runner fails a seeded request whose prompt is prefilled over two
    steps (it rewinds the request's torch.Generator with set_offset, which a CPU generator does not have); a prompt
    then waits for a step with room for all of it, and a step must hold the longest sequence (max_model_len tokens:
    the engine's context)."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, max_model_len)}


def start_colocated_engine(
    policy,
    device,
    processor=None,
    lora_rank: Optional[int] = None,
    *,
    model_name_or_path: str,
    seed: int,
    dtype: str,
    trust_remote_code: bool,
    vllm_max_model_length: Optional[int],
    max_prompt_length: int,
    max_completion_length: int,
    gpu_memory_utilization: float,
    enforce_eager: bool,
    enable_sleep_mode: bool,
    cpu_kv_cache_gib: float,
):
    """A vllm.LLM in this process (TRL's vllm_mode="colocate"), on the training device, built from the policy's config
    with placeholder weights (the policy's are pushed). Returns the engine and the folder of its config.json. A VLM's
    processor goes in the folder too: vLLM turns each image into the model's inputs with it. lora_rank: as
    engine_options takes it, with seed, dtype, trust_remote_code, gpu_memory_utilization, enforce_eager and
    enable_sleep_mode; its context: engine_max_model_len of vllm_max_model_length, max_prompt_length and
    max_completion_length (the options), at most the policy's positions; cpu_kv_cache_gib (--vllm_cpu_kv_cache_gib):
    the KV cache's GiB on a CPU; model_name_or_path: the model an error names."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: tensors pass as is
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib)  # check_vllm_args refused a clash
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
    max_model_len = engine_max_model_len(
        vllm_max_model_length=vllm_max_model_length,
        max_prompt_length=max_prompt_length,
        max_completion_length=max_completion_length,
    )
    if positions is not None and max_model_len > positions:
        given = (
            f"--vllm_max_model_length {max_model_len}"
            if vllm_max_model_length
            else f"--max_prompt_length + --max_completion_length ({max_prompt_length} + {max_completion_length})"
        )
        raise UsageError(
            f"{given} exceeds the {positions} positions of {model_name_or_path} (max_position_embeddings): lower it"
        )
    folder = tempfile.TemporaryDirectory(prefix="rloo_vllm_config_")  # config.json only, no weights
    config = policy.config.to_dict()
    config.pop("quantization_config", None)  # a GGUF file's: the policy itself is de-quantised
    with open(os.path.join(folder.name, "config.json"), "w") as f:
        json.dump(config, f)
    if processor is not None:
        processor.save_pretrained(folder.name)
    try:
        options = engine_options(
            folder.name,
            device,
            multimodal=processor is not None,
            lora_rank=lora_rank,
            seed=seed,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
        )
        return LLM(**options), folder
    except Exception as e:
        detail = " ".join(str(e).split())[:400]  # vLLM's configuration errors span several lines
        raise UsageError(
            f"vLLM could not start an engine for {model_name_or_path} ({type(e).__name__}: {detail}): "
            "check the --vllm_* options (`--help`)"
        ) from None


class ColocatedVLLM:
    """A vLLM engine in this process (TRL's vllm_mode="colocate"), on the training device; push_weights copies the
    policy's tensors into it through vLLM's reload_weights. Of a LoRA policy whose adapter vLLM's LoRA serves
    (--vllm_lora_push), the base weights go once, at the first push, and then the adapter alone after every update, as
    files that vLLM loads (a LoRARequest, which every generate names); last_push_bytes: what the last push sent."""

    # The merged push until __init__ says otherwise (an engine built without it, as tests build one, pushes as before)
    adapter, lora_request, adapter_folder, last_push_bytes = False, None, None, 0

    def __init__(
        self,
        args,
        policy,
        device,
        processor=None,
    ):
        """An engine of the policy's architecture (a VLM's processor with it) on `device`, started with the options of
        these names (start_colocated_engine). With --use_peft its adapter is served alone where vLLM's LoRA can
        serve one of rank lora_r, use_dora and lora_modules_to_save (vllm_options.adapter_problem) and
        vllm_lora_push allows; else the merged weights are pushed."""
        problem = None
        if args.use_peft:
            problem = adapter_problem(args.lora_options(), args.model_name_or_path, policy)
            problem = problem or lora_architecture_problem(policy)
        self.adapter = args.use_peft and choose_lora_push(args.vllm_lora_push, problem)
        lora_rank = vllm_lora_rank(args.lora_r) if self.adapter else None
        dtype = engine_dtype(args.vllm_dtype)  # what the engine holds its weights in
        self.llm, self.folder = start_colocated_engine(
            policy,
            device,
            processor,
            lora_rank,
            model_name_or_path=args.model_name_or_path,
            seed=args.seed,
            dtype=dtype,
            trust_remote_code=args.trust_remote_code,
            vllm_max_model_length=args.vllm_max_model_length,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            enforce_eager=args.vllm_enforce_eager,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            cpu_kv_cache_gib=args.vllm_cpu_kv_cache_gib,
        )
        self.dtype = getattr(torch, dtype)
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
