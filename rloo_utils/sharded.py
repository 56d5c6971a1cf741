"""Sharded models (rloo_multigpu.py): built empty, each process reading and writing only its own rows of the safetensors
files; a run's models sharded; sharded checkpoints of the policy and its optimizer; a sharded reward model's Scorer."""

import contextlib
import json
import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from rloo_utils.checkpoints import check_checkpoint_finite, is_saved_model, save_model
from rloo_utils.errors import RunError, UsageError, describe
from rloo_utils.lora import (
    adapter_layers,
    add_adapter,
    is_peft_model,
    merged_weight,
    merged_weights,
    plain_name,
    plain_state_dict,
    trained_names,
    transformers_model,
)
from rloo_utils.models import (
    MODEL_OPTIONS,
    SAFETENSORS_DTYPES,
    checked_reward_model,
    checkpoint_dtype,
    checkpoint_weights,
    disable_dropout,
    from_pretrained,
    frozen_linear_weights_to,
    model_dtype,
    policy_class,
)
from rloo_utils.processes import agreed, get_rank, whole
from rloo_utils.scoring import Scorer
from rloo_utils.set_up import Models, RunPlan, load_checked_tokenizers


@dataclass
class ShardingOptions:
    """FSDP2: the processes, and where the shards are while they generate and between uses (docs/multigpu.md)"""

    # the timeout changes nothing computed (gathered generation keeps a static KV cache, and sharded generation cannot:
    # their samples differ)
    RESUMABLE: ClassVar = {"ddp_timeout"}

    gather_for_generation: bool = True
    """gather the whole policy on every process while it generates (old TRL's ds3_gather_...)"""
    fsdp_cpu_offload: bool = False
    """keep the shards, gradients and optimizer state in CPU memory between uses (slower, less GPU memory)"""
    ddp_timeout: int = 1800
    """seconds a process waits for the others at a collective before the run fails (a process that died or hangs)"""

    def check(self) -> None:
        """--sampler_weights: HF generate samples from the policy's own weights here (gathered, or sharded)."""
        if self.sampler_weights != "auto":
            raise UsageError(
                f"--sampler_weights {self.sampler_weights}: rloo_multigpu.py samples from the weights FSDP gathers "
                "(bfloat16 under --bf16, its mixed precision), never a copy: leave it out"
            )


def load_sharded_models(
    args,
    plan: RunPlan,
    device,
    world_size: int,
) -> Models:
    """set_up.load_models for a process group (the same values, and fsdp_cpu_offload, --fsdp_cpu_offload: the shards in
    CPU memory between uses): the tokenizers, and the policy, its reference and the reward model sharded over the
    world_size processes by FSDP2 (shard). Every process builds the models on the meta device (no memory) and shards
    them; each then reads only its shards of the weights (load_shards), so that no process holds a whole model. The
    reference is the initial policy, frozen, needed only for the KL penalty (beta > 0), sharded as the policy is (with
    bf16 both compute in bf16, its frozen linear layers held so), so that the KL is exactly 0 before training; with
    use_peft the policy, adapter disabled. A resumed policy's weights (with use_peft its adapter's) come from its
    checkpoint (load_sharded_checkpoint, with the optimizer's state)."""
    with agreed():
        tokenizer, reward_tokenizer, processor = load_checked_tokenizers(
            plan,
            model_name_or_path=args.model_name_or_path,
            sft_model_path=args.sft_model_path,
            reward_model_path=args.reward_model_path,
            stop_token_id=args.stop_token_id,
            chat_template_kwargs=args.chat_template_kwargs,
        )
        policy_path = args.sft_model_path or args.model_name_or_path
        policy = empty_model(
            policy_class(policy_path),
            policy_path,
            model_dtype(args.dtype, policy_path),
            weights=plan.checkpoint is None or args.use_peft,  # (a LoRA checkpoint holds the adapter only)
            attn_implementation=args.attn_implementation,
        )
        ref_policy = None
        if args.beta > 0 and not args.use_peft:  # only the policy learns
            ref_policy = empty_model(
                policy_class(policy_path),
                policy_path,
                model_dtype(args.dtype, policy_path),
                attn_implementation=args.attn_implementation,
            ).requires_grad_(False)
        reward_model = load_sharded_reward_model(args.reward_model_path) if args.reward_model_path else None
    disable_dropout(policy)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    if args.use_peft:
        policy = add_adapter(policy, **args.lora_options(), seed=args.seed, model_path=policy_path)
        ref_policy = policy if args.beta > 0 else None
    for model in (
        policy,
        ref_policy,
        reward_model,
    ):  # frozen linear layers in bf16 under --bf16, as FSDP gathers them
        frozen_linear_weights_to(model, torch.bfloat16 if args.bf16 else None)
    mesh = init_device_mesh(device.type, (world_size,))
    for model in dict.fromkeys(m for m in (policy, ref_policy, reward_model) if m is not None):  # each model once
        shard(model, mesh, args.bf16, args.fsdp_cpu_offload)
    return Models(tokenizer, reward_tokenizer, processor, policy, ref_policy, reward_model)


def empty_model(auto_class, path: str, dtype, weights: bool = True, **config_kwargs):
    """auto_class.from_pretrained(path, dtype=dtype, **config_kwargs), but on the meta device (no memory), to be sharded
    and then filled by load_shards, so that no process holds the whole model: each reads its own slices of path's
    safetensors files. Where the files hold other tensors than the model's, renamed at most (experts that
    transformers fuses on load, a .gguf file), rank 0 loads the model whole here and load_shards sends each process
    its shards. weights=False: the weights come from elsewhere (a checkpoint to resume) and are not read. The model's
    `missing_weights`: those path does not hold, which from_pretrained would initialise anew (rank 0's, where rank 0
    loads it; none when streamed); its `saved_names`: each weight's name in the files (None: not a renaming)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, GenerationConfig
    from transformers.core_model_loading import revert_weight_conversion

    config = from_pretrained(AutoConfig, path, **config_kwargs)
    found = checkpoint_weights(path)
    if dtype == "auto":  # as from_pretrained
        dtype = checkpoint_dtype(path, config, found)
    with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed, not read: keep them
        options = MODEL_OPTIONS.get(path, {})
        code = (
            {"trust_remote_code": True}
            if options.get("trust_remote_code") and getattr(config, "auto_map", None)
            else {}
        )
        model = auto_class.from_config(config, dtype=dtype, **code)  # (config_kwargs' attn_implementation: in config)
    model.tie_weights()  # (from_pretrained ties them after loading)
    model.eval()  # as from_pretrained returns a model
    folder = found[0] if found else os.path.dirname(os.path.abspath(path)) if path.endswith(".gguf") else path
    if model.can_generate() and os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(folder)
    # The names a checkpoint holds each weight under: a tied weight (the LM head of tied embeddings) once, under the
    # name transformers saves it under (renamed as its conversions for the model's family revert them: LLaVA's
    # language_model.model.* for model.language_model.*), as save_pretrained writes them
    tied = set(dict(model.named_parameters(remove_duplicate=False))) - set(dict(model.named_parameters()))
    state = {name: tensor for name, tensor in model.state_dict().items() if name not in tied}
    name_of = {id(tensor): name for name, tensor in state.items()}
    saved_as = {
        name_of.get(id(tensor)): saved for saved, tensor in revert_weight_conversion(model, dict(state)).items()
    }
    # (kept for save_sharded_model: once sharded, the model's classes are FSDP's, for which transformers knows no names)
    model.saved_names = saved_as if saved_as.keys() == state.keys() else None  # None: tensors converted, not renamed
    streamed = (
        found is not None
        and model.saved_names is not None
        and all(found[1].get(saved_as[name], (None,))[0] == tuple(tensor.shape) for name, tensor in state.items())
    )
    model.pretrained_weights = None
    model.missing_weights = []
    if weights and streamed:
        model.pretrained_weights = (found[0], saved_as)
    elif weights:
        full = None
        if get_rank() == 0:
            loaded, info = from_pretrained(auto_class, path, dtype=dtype, output_loading_info=True, **config_kwargs)
            full, model.missing_weights = loaded.state_dict(), sorted(info["missing_keys"])
        model.pretrained_weights = (None, full)
    return model


def load_sharded_reward_model(path: str):
    """The reward model as an empty_model in float32, to be sharded and filled by load_shards; refused as
    load_reward_model refuses it."""
    from transformers import AutoModelForSequenceClassification

    model = empty_model(AutoModelForSequenceClassification, path, torch.float32, num_labels=1)
    return checked_reward_model(model, model.missing_weights, path)


def load_shards(model, device) -> None:
    """Allocate the shards of an empty_model, sharded (FSDP2), on `device` (the CPU with FSDP's CPU offload), and fill
    them with its weights: each process reads only its own slices of the safetensors files
    (torch.distributed.checkpoint's HuggingFaceStorageReader, casting to the model's dtype), or rank 0 sends each
    process its shards of the whole model it loaded (set_model_state_dict's broadcast_from_rank0, one tensor at a time).
    A collective: every process calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if (
        "pretrained_weights" not in transformers_model(model).__dict__
    ):  # loaded whole, then sharded: its shards are filled
        return
    source = transformers_model(model).__dict__.pop("pretrained_weights")
    buffers = [(module, name, b) for module in model.modules() for name, b in module._buffers.items() if b is not None]
    model.to_empty(device=device)
    for module, name, b in buffers:  # computed at build and on the device FSDP put them on: to_empty left them blank
        module._buffers[name] = b
    if source is not None:  # (None: filled by the caller, from a resumed checkpoint)
        folder, saved_as_or_full = source  # keyed by the names of the model without adapters (plain_name)
        state = get_model_state_dict(model)
        names = {name: plain_name(name) if is_peft_model(model) else name for name in state}
        if folder is not None:  # saved_as: the model's name of each weight -> its name in the files
            saved_as = {name: saved_as_or_full[plain] for name, plain in names.items() if plain in saved_as_or_full}
            in_files = {saved: state[name] for name, saved in saved_as.items()}
            dcp.load(
                in_files,
                storage_reader=dcp.HuggingFaceStorageReader(folder),
                planner=DefaultLoadPlanner(allow_partial_load=True),
            )  # (the files' other tensors: a tied head's copy)
            set_model_state_dict(
                model,
                {name: in_files[saved] for name, saved in saved_as.items()},
                options=StateDictOptions(strict=False),
            )
        else:  # the whole model's state dict on rank 0 (None elsewhere)
            full = {name: saved_as_or_full[plain] for name, plain in names.items() if plain in (saved_as_or_full or {})}
            set_model_state_dict(
                model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
            )
    if getattr(model, "adapter_init", None) is not None:  # LoRA adapters drawn at build, the same on every process
        set_model_state_dict(model, model.adapter_init, options=StateDictOptions(full_state_dict=True, strict=False))
        with torch.no_grad():  # DoRA's magnitudes: the row norms of the weights now read (both sharded by rows)
            for module in model.modules():
                if getattr(module, "use_dora", {}).get("default"):
                    module.lora_magnitude_vector["default"].weight.copy_(
                        torch.linalg.norm(module.get_base_layer().weight, dim=1)
                    )


def safetensors_header(shapes: dict) -> bytes:
    """The start of a safetensors file whose tensors (meta tensors: their shapes and dtypes) follow in this order: a
    little-endian u64 length, then the JSON header of each tensor's dtype, shape and byte range, padded with spaces so
    that the tensors' bytes start 8-byte aligned, as safetensors writes it."""
    dtype_names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in shapes.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(header, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def save_sharded_model(output_dir: str, model, tokenizer, max_shard_size: str = "5GB", merged: bool = False) -> None:
    """save_pretrained's folder (config, generation config, safetensors weights in files of at most max_shard_size and
    their index, the tokenizer) of a sharded empty_model, under the names save_pretrained gives the weights, without
    any process holding the whole model: the weights are gathered one tensor at a time (every process takes part)
    and rank 0 appends each to its file, whose header it wrote first from the shapes. A model that transformers saves
    as other tensors (fused experts, split again) is gathered on rank 0 and saved by save_pretrained. A collective:
    every process calls it; a failure on rank 0 still goes through every gather, then stops all of them. A peft model
    saves its adapter, or with merged=True the model with the adapter merged into its weights."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if is_peft_model(model) and not merged:  # the adapter: small, gathered whole
        trained = trained_names(model)
        save_model(
            output_dir,
            model,
            tokenizer,
            {name: whole(t).cpu() for name, t in get_model_state_dict(model).items() if name in trained},
        )
        return
    saved_names, layers = transformers_model(model).saved_names, adapter_layers(model)
    if saved_names is None:  # saved as other tensors than the model's (experts split apart): whole on rank 0
        state = {}
        for name, tensor in merged_weights(model, whole):
            if get_rank() == 0:
                state[name] = tensor.cpu()
        save_model(output_dir, model, tokenizer, state, merged=True)
        return
    state = plain_state_dict(model)
    plain = {saved_name: name for name, saved_name in saved_names.items()}
    saved = {saved_name: state[name] for name, saved_name in saved_names.items()}  # a tied weight once
    shapes = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in saved.items()}
    split = split_torch_state_dict_into_shards(
        shapes, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    error = None
    with agreed():
        for file, names in split.filename_to_tensors.items():
            stream = None
            if get_rank() == 0 and error is None:
                try:
                    os.makedirs(output_dir, exist_ok=True)
                    stream = open(os.path.join(output_dir, file), "wb")
                    stream.write(safetensors_header({name: shapes[name] for name in names}))
                except Exception as e:
                    error = e
            for name in names:
                tensor = whole(saved[name])
                if plain[name] in layers:  # its adapter merged in
                    tensor = merged_weight(layers[plain[name]], tensor, whole)
                if stream is not None and error is None:
                    try:
                        stream.write(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
                    except Exception as e:
                        error = e
            if stream is not None:
                stream.close()
        if error is not None:
            raise RunError(f"could not save the trained model to {output_dir} ({describe(error)})")
        if get_rank() == 0:
            if split.is_sharded:
                with open(os.path.join(output_dir, "model.safetensors.index.json"), "w") as f:
                    json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
            model.config.dtype = str(model.dtype).split(".")[1]  # what save_pretrained records with the weights
            name = type(transformers_model(model)).__name__.removeprefix("FSDP")
            model.config.architectures = [name]
            model.config.save_pretrained(output_dir)
            if (
                getattr(model, "_auto_class", None) is not None
            ):  # its own code (--trust_remote_code), as save_pretrained
                from transformers.dynamic_module_utils import custom_object_save

                custom_object_save(
                    next(c for c in type(transformers_model(model)).__mro__ if c.__name__ == name), output_dir
                )
            if model.can_generate():
                model.generation_config.save_pretrained(output_dir)
            tokenizer.save_pretrained(output_dir)
            if not is_saved_model(output_dir):
                raise RunError(
                    f"could not save the trained model to {output_dir}: config.json or the weights are "
                    "missing after saving"
                )


def sharded_training_state(policy, optimizer) -> tuple[dict, dict]:
    """The policy's (a peft model's adapter only: trained_names) and the optimizer's state dicts of shards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(policy, optimizer)
    trained = trained_names(policy)
    return {k: v for k, v in model_state.items() if trained is None or k in trained}, optimizer_state


def save_sharded_checkpoint(folder: str, policy, optimizer) -> None:
    """The policy and optimizer state of a checkpoint: every process writes its shards (torch.distributed.checkpoint,
    which fsyncs them)."""
    import torch.distributed.checkpoint as dcp

    model_state, optimizer_state = sharded_training_state(policy, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(folder, "dcp"))


def load_sharded_checkpoint(checkpoint: str, policy, optimizer) -> None:
    """The sharded policy and optimizer state of a checkpoint (torch.distributed.checkpoint shards in dcp/), each
    process reading its own shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    model_state, optimizer_state = sharded_training_state(policy, optimizer)
    # A weight that never had a gradient (a VLM's vision layers after the one it reads) has no AdamW state to load
    saved = dcp.FileSystemReader(os.path.join(checkpoint, "dcp")).read_metadata().state_dict_metadata
    optimizer_state["state"] = {
        name: values
        for name, values in optimizer_state["state"].items()
        if all(f"optimizer.state.{name}.{key}" in saved for key in values)
    }
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, "dcp"))
    set_model_state_dict(policy, state["model"], options=StateDictOptions(strict=trained_names(policy) is None))
    set_optimizer_state_dict(policy, optimizer, state["optimizer"], options=StateDictOptions(strict=False))
    check_checkpoint_finite(policy, checkpoint)


def shard(model: torch.nn.Module, mesh, mixed_precision: bool, cpu_offload: bool) -> torch.nn.Module:
    """FSDP2, then the weights of a model built empty read into its shards (load_shards). Each decoder layer (the
    classes transformers lists in _no_split_modules) is a unit whose weights are gathered for its forward and freed
    after it; the root holds the rest (embeddings, tied LM head, norm). A VLM's
    vision tower is sharded the same way: its encoder layers and patch embeddings are in _no_split_modules. A reward
    model's backbone and score head are units of their own: reward_model_scores calls them one by one. Gradients are
    summed over the processes, not averaged: each process's loss is already its share of the global loss."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else None,
    }
    options = {k: v for k, v in options.items() if v is not None}
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, **options)
    if hasattr(model, "score"):
        fully_shard(getattr(model, model.base_model_prefix), **options)
        fully_shard(model.score, **options)
    root = transformers_model(model)  # (not a peft wrapper, whose forward generate goes around)
    fully_shard(root, **options)
    load_shards(
        model, "cpu" if cpu_offload else mesh.device_type
    )  # the weights of an empty_model, each process its own
    if (
        getattr(model.config, "vision_config", None) is not None
    ):  # generate runs a VLM's vision tower before the model's
        root._get_fsdp_state()._lazy_init()  # forward, and FSDP2 makes the first unit to run the root: fix it now
    for module in model.modules():
        if isinstance(module, FSDPModule):  # a plain sum (gloo has no pre-multiplied sum), divided by 1
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Every unit of a model that only runs forwards (the reference, the reward model) back in shards: FSDP2 never
    reshards a root after its forward (lazy init clears the root's post-forward mesh), only a backward does, so without
    this the root's weights (embeddings, LM head; a reward model's backbone and score head) would stay gathered."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def gathered(model: torch.nn.Module, enabled: bool):
    """The sharded model whole on every process for the duration of the block (FSDP2's unshard of every unit),
    resharded after it."""
    if not enabled:
        yield
        return
    units, root = [m for m in model.modules() if isinstance(m, FSDPModule)], transformers_model(model)
    root.set_reshard_after_forward(False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        root.set_reshard_after_forward(True)
        root.set_reshard_after_forward(False, recurse=False)  # FSDP's own setting for the root


class ShardedScorer(Scorer):
    """The Scorer of a sharded reward model: its parameters, gathered for the forward, are freed again after it."""

    def model_scores(self, rollout, texts: list[str]) -> torch.Tensor:
        scores = super().model_scores(rollout, texts)
        reshard(self.reward_model)
        return scores
