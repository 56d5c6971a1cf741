"""LoRA adapters (peft): added to the policy, disabled for the reference, merged for vLLM and for saving, or sent to
vLLM alone (its LoRA serves them on the base weights)."""

import contextlib
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, fields
from typing import Callable, ClassVar, Optional

import torch

from rloo_utils.errors import UsageError, describe
from rloo_utils.paths import same_path


@dataclass
class LoraOptions:
    """LoRA adapters (peft; TRL's ModelConfig names; docs/lora.md)"""

    RESUMABLE: ClassVar = {"save_merged_model"}  # an output of the run's end

    use_peft: bool = False
    """train LoRA adapters (Hu et al. 2021) on the frozen policy; the reference is it with its adapter off"""
    lora_r: int = 16
    """rank r of each adapter B A"""
    lora_alpha: int = 32
    """each adapter adds (alpha / r) B A to its layer's weight"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input in the update (TRL: 0.05; 0 here, so the update's log-probs are the sampler's)"""
    lora_target_modules: Optional[list[str]] = None
    """the linear layers that get adapters (e.g. q_proj v_proj), or all-linear; None: peft's default for the model"""
    lora_modules_to_save: Optional[list[str]] = None
    """layers trained in full next to the adapters (e.g. an untied lm_head), saved with them"""
    use_dora: bool = False
    """DoRA (Liu et al. 2024): a trained magnitude times the direction of W + (alpha / r) B A"""
    save_merged_model: bool = False
    """also save the policy with its adapter merged in (a plain model, e.g. for vLLM) to <output_dir>/merged"""

    def lora_options(self) -> dict:
        """add_adapter's options: the adapter's rank, scale, dropout, layers and kind."""
        names = ["lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save", "use_dora"]
        return {name: getattr(self, name) for name in names}

    def check(self) -> None:
        """The LoRA options: only with --use_peft, in range, and never a reward model that is the policy's own
        weights."""
        defaults = {field.name: field.default for field in fields(self)}  # the Args' own: a fork's may differ
        given = [f"--{name}" for name in LORA_OPTIONS if getattr(self, name) != defaults[name]]
        if given and not self.use_peft:
            raise UsageError(
                f"{' '.join(given)} set{'s' if len(given) == 1 else ''} up LoRA adapters, which --use_peft "
                "turns on: add --use_peft, or leave them out"
            )
        if not self.use_peft:
            return
        if self.lora_r < 1 or not self.lora_alpha > 0:
            raise UsageError(f"--lora_r must be >= 1 and --lora_alpha > 0, got {self.lora_r} and {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise UsageError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_target_modules == []:
            raise UsageError(
                "--lora_target_modules is empty: name the layers that get adapters (or all-linear), or leave "
                "it out for peft's default of the architecture"
            )
        policy = self.sft_model_path or self.model_name_or_path
        if self.reward_model_path is not None and same_path(self.reward_model_path, policy):
            raise UsageError(
                f"--reward_model_path {self.reward_model_path} is the policy's own model: with --use_peft the "
                "policy's weights are the base its adapter trains on, not a reward model; give a sequence "
                "classifier trained to score completions"
            )


# The options that shape the adapters (all but --use_peft, which adds them): refused without it
LORA_OPTIONS = [
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_modules_to_save",
    "use_dora",
    "save_merged_model",
]


def is_peft_model(model) -> bool:
    return "peft" in sys.modules and isinstance(model, sys.modules["peft"].PeftModel)


def transformers_model(model):
    """The transformers model itself, or the one a peft adapter wraps (its modules hold the adapter layers)."""
    return model.get_base_model() if is_peft_model(model) else model


def add_adapter(
    model,
    *,
    lora_r: int,
    lora_alpha: int,
    lora_dropout: float,
    lora_target_modules: Optional[list[str]],
    lora_modules_to_save: Optional[list[str]],
    use_dora: bool,
    seed: int,
    model_path: str,
):
    """--use_peft: the model frozen, with LoRA adapters (Hu et al. 2021; DoRA, Liu et al. 2024, with use_dora) of rank
    lora_r, scaled by lora_alpha / lora_r, lora_dropout on their input, on the layers lora_target_modules names, beside
    the lora_modules_to_save trained in full (peft's get_peft_model; the LoraOptions of those names). The adapters are
    drawn as peft draws them (A: Kaiming-uniform, B = 0, so that the policy starts as the model) from a generator of
    seed (--seed) alone, on the CPU: the same adapters in every script, process and device, and no other random state
    touched. model_path: where the model was read from, which an error names.
    Of a model built empty (empty_model) they are drawn on the CPU and kept in `adapter_init` for load_shards, which
    also computes DoRA's magnitudes (the row norms of the weights) once the weights are read."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear, LoraLayer

    targets = lora_target_modules
    config = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,  # (a list: names)
        modules_to_save=lora_modules_to_save,
        use_dora=use_dora,
        task_type="CAUSAL_LM",
    )
    where = model_path
    names_of = defaultdict(list)  # a weight shared by several modules (tied embeddings and LM head) has several names
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of[id(p)].append(name.rpartition(".")[0])
    tied = {module for names in names_of.values() if len(names) > 1 for module in names}
    modules = [name for name, _ in model.named_modules()]  # peft trains in full each one whose name ends with one given
    unmatched = [t for t in lora_modules_to_save or [] if not any(m.endswith(t) for m in modules)]
    if unmatched:
        raise UsageError(
            f"--lora_modules_to_save {' '.join(unmatched)} names no layer of {where}, so nothing of it "
            "would train: name layers it has (e.g. lm_head, score), or leave it out"
        )
    untied = [t for t in lora_modules_to_save or [] if any(m == t or m.endswith(f".{t}") for m in tied)]
    if untied:
        raise UsageError(
            f"--lora_modules_to_save {' '.join(untied)}: its weight is tied to another layer's in {where} "
            "(tie_word_embeddings); a trained copy would untie them, which vLLM and a saved model's config "
            "undo: leave it out"
        )
    try:
        model = get_peft_model(model, config)
    except (ValueError, KeyError, TypeError) as e:  # no layer matched; an architecture peft has no default for
        targets = " ".join(lora_target_modules or ["(peft's default)"])
        raise UsageError(
            f"--lora_target_modules {targets} gives {where} no adapter ({describe(e)}): name its linear "
            "layers (e.g. q_proj v_proj), or all-linear"
        ) from None
    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    others = sorted(
        f"{name} ({type(module.get_base_layer()).__name__})"
        for name, module in layers.items()
        if not isinstance(module, Linear)
    )
    if others:
        raise UsageError(
            f"--lora_target_modules gives adapters to layers that are not linear: {', '.join(others[:3])}; "
            "only linear layers take them here (merged into the weights vLLM samples from): leave those out"
        )
    transposed = sorted(name for name, module in layers.items() if module.fan_in_fan_out)
    if use_dora and transposed:
        raise UsageError(
            f"--use_dora on {transposed[0].removeprefix('base_model.model.')}, a layer that stores its "
            "weight transposed (GPT-2's Conv1D): DoRA's row norms are not supported there; leave out --use_dora"
        )
    on_tied = sorted(name for name in layers if plain_name(name) in tied)
    if on_tied:
        raise UsageError(
            f"--lora_target_modules gives an adapter to {on_tied[0].removeprefix('base_model.model.')}, "
            f"whose weight is tied to another layer's in {where} (tie_word_embeddings); merged, it would "
            "untie them, which vLLM and a saved model's config undo: leave it out"
        )
    built_empty = any(p.is_meta for p in model.parameters())
    generator = torch.Generator().manual_seed(seed)  # on the CPU whatever the device: the same draws everywhere
    with torch.no_grad():
        for module in layers.values():
            if built_empty:
                module.lora_A.to_empty(device="cpu")
                module.lora_B.to_empty(device="cpu")
            A = module.lora_A["default"].weight  # (r, in)
            A.copy_(torch.nn.init.kaiming_uniform_(torch.empty(A.shape), a=math.sqrt(5), generator=generator))
            module.lora_B["default"].weight.zero_()
    if built_empty:
        model.adapter_init = {
            name: p.detach().clone() for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name
        }
    return model


def adapter_disabled(model):
    """The base model for the duration of the block: a peft model with its adapters off (the reference of
    --use_peft)."""
    return model.disable_adapter() if is_peft_model(model) else contextlib.nullcontext()


def plain_name(name: str) -> str:
    """A peft model's weight name as the model without adapters names it."""
    name = name.removeprefix("base_model.model.")
    for part in (".base_layer", ".original_module", ".modules_to_save.default"):
        name = name.replace(part, "")
    return name


def plain_state_dict(model) -> dict:
    """state_dict() under the names of the model without adapters: of a peft model the base weights (where an adapter
    sits, the weight before merging; a --lora_modules_to_save layer's trained copy), without the adapters' own."""
    if not is_peft_model(model):
        return model.state_dict()
    return {
        plain_name(name): tensor
        for name, tensor in model.state_dict().items()
        if ".lora_" not in name and ".original_module." not in name
    }


def adapter_layers(model) -> dict:
    """{plain name of a weight: the LoRA layer whose adapter merges into it}."""
    if not is_peft_model(model):
        return {}
    from peft.tuners.lora import LoraLayer

    return {plain_name(f"{name}.weight"): m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_weight(layer, weight: torch.Tensor, gather: Callable = lambda t: t) -> torch.Tensor:
    """W + (alpha / r) B A of a LoRA layer, from its whole base weight; DoRA: m (W + s B A) / ||W + s B A|| row by row
    (Liu et al. 2024, eq. 5), as peft merges them. gather: a shard -> the whole tensor. The layer is not changed (peft's
    merge_adapter would add and later subtract the delta in place, which rounds the trained weights)."""
    A, B = gather(layer.lora_A["default"].weight.detach()), gather(layer.lora_B["default"].weight.detach())
    delta = (B.float() @ A.float()) * layer.scaling["default"]  # (out, in)
    if layer.fan_in_fan_out:
        delta = delta.T
    merged = weight.float() + delta
    if layer.use_dora["default"]:
        magnitude = gather(layer.lora_magnitude_vector["default"].weight.detach()).float()  # (out,)
        merged = merged * (magnitude / merged.norm(dim=1)).view(-1, 1)
    return merged.to(weight.dtype)


def to_dtype(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A floating-point tensor in dtype (None: as it is); integer buffers stay as they are."""
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def merged_weights(model, gather: Callable = lambda t: t, dtype: Optional[torch.dtype] = None):
    """(name, tensor) of every weight of the model as a plain transformers model, its adapters merged in, one tensor at
    a time (of sharded weights, each gathered: a collective every process goes through in the same order). dtype: the
    floating-point tensors in it (a push to vLLM in the engine's dtype), cast before they are gathered; a merged weight
    is merged from its whole base weight, then cast."""
    layers = adapter_layers(model)
    for name, tensor in plain_state_dict(model).items():
        if name in layers:
            yield name, to_dtype(merged_weight(layers[name], gather(tensor.detach()), gather), dtype)
        else:
            yield name, gather(to_dtype(tensor.detach(), dtype))


def base_weights(model, gather: Callable = lambda t: t, dtype: Optional[torch.dtype] = None):
    """(name, tensor) of every weight of the model as a plain transformers model, without its adapters: the base that
    vLLM serves an adapter on (pushed once, as merged_weights pushes them: gathered one at a time, cast first)."""
    for name, tensor in plain_state_dict(model).items():
        yield name, gather(to_dtype(tensor.detach(), dtype))


def adapter_weights(model, gather: Callable = lambda t: t, dtype: Optional[torch.dtype] = None):
    """(name, tensor) of the LoRA adapters alone, named as peft's adapter_model.safetensors names them (the adapter's
    name left out: base_model.model.<layer>.lora_A.weight), which vLLM's LoRA loads; gathered one at a time, cast
    first. The magnitudes of DoRA and the --lora_modules_to_save layers are not in it: vLLM serves neither."""
    for name, tensor in model.state_dict().items():
        if ".lora_A.default." in name or ".lora_B.default." in name:
            name = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            yield name, gather(to_dtype(tensor.detach(), dtype))


def trained_names(model) -> Optional[set]:
    """The weights a checkpoint holds of a peft model: its adapters (and --lora_modules_to_save layers), the frozen
    base being read again from the model's files; None: all of them."""
    return {name for name, p in model.named_parameters() if p.requires_grad} if is_peft_model(model) else None
