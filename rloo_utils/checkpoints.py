"""Checkpoint files and exact resume: the options of a run's folder and checkpoints (CheckpointOptions), the trained
model saved and checked, a checkpoint written whole or not at all (fsynced, then renamed into place) and found again,
the checkpoint a resume names checked against the run's options, its weights, training state and random generators'
states loaded, and the command that continues a run. What a run does with them over its life is lifecycle.py's."""

import json
import os
import random
import re
import shlex
import shutil
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import numpy as np
import torch
import torch.distributed as dist

from rloo_utils.data import dataset_path
from rloo_utils.errors import RunError, UsageError, describe
from rloo_utils.lora import is_peft_model, merged_weights, trained_names, transformers_model
from rloo_utils.models import from_pretrained, weights_finite
from rloo_utils.processes import agreed, get_rank, get_world_size, launch_world_size


@dataclass
class CheckpointOptions:
    """The run's folder, checkpoints and resume (docs/resume.md)"""

    # the options a resumed run may change (options.resumable_options): where it writes and how often, none of what it
    # computes
    RESUMABLE: ClassVar = {
        "run_name",
        "output_dir",
        "resume_from_checkpoint",
        "save_steps",
        "save_total_limit",
        "max_skipped_steps",
    }

    run_name: Optional[str] = None
    """the run folder is runs/<run_name>; None: <exp_name>__<seed>__<unix time>"""
    output_dir: Optional[str] = None
    """where the trained model and tokenizer are saved; None: runs/<run_name>/model"""
    save_steps: int = 0
    """write runs/<run_name>/checkpoints/checkpoint-<update> every N updates (0: only on SIGINT/SIGTERM)"""
    save_total_limit: Optional[int] = None
    """keep only the newest K checkpoints; None: keep them all"""
    resume_from_checkpoint: Optional[str] = None
    """continue a run exactly: a checkpoint folder, a run folder, or `latest` (of --run_name)"""
    max_skipped_steps: int = 10
    """stop the run when this many optimizer steps in a row were skipped for a non-finite loss or gradient"""

    def check(self) -> None:
        """The run's folder names (--exp_name's too: runs/<exp_name>__...) and what is kept of its checkpoints."""
        for name in ["run_name", "exp_name"]:
            value = getattr(self, name)
            if value is not None and (value in ("", ".", "..") or "/" in value):
                raise UsageError(f"--{name} names a folder in runs/ and must be a plain name (no '/'), got {value!r}")
        if self.output_dir == "":
            raise UsageError("--output_dir is empty: give a folder, or leave it out for runs/<run_name>/model")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise UsageError(
                f"--save_total_limit must be >= 1 (or left out to keep every checkpoint), got {self.save_total_limit}"
            )


def load_checkpoint_weights(policy, folder: str) -> None:
    """The policy weights of a rloo.py / rloo_vllm.py checkpoint, saved by save_pretrained: a whole model, or a peft
    model's adapter (adapter_model.safetensors), each checked to fit the policy exactly, and to be finite."""
    if not is_peft_model(policy):
        policy.load_state_dict(from_pretrained(type(policy), folder).state_dict())
        check_checkpoint_finite(policy, folder)
        return
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        adapter = load_file(os.path.join(folder, "adapter_model.safetensors"))
    except Exception as e:
        raise UsageError(f"could not load the adapter of {folder} ({describe(e)})") from None
    try:
        result = set_peft_model_state_dict(policy, adapter)
        trained = trained_names(policy)
        missing = sorted(name for name in result.missing_keys if name in trained)
        unexpected = result.unexpected_keys
        problem = f"missing {missing[:2]}, unexpected {unexpected[:2]}" if missing or unexpected else ""
    except RuntimeError as e:  # shapes that do not fit (another rank)
        problem = describe(e)
    if problem:
        raise UsageError(
            f"the adapter of {folder} does not fit the policy ({problem}): resume with the --lora_* "
            "options the run was started with"
        )
    check_checkpoint_finite(policy, folder)


def check_checkpoint_finite(policy, folder: str) -> None:
    """A checkpoint's trained weights with an inf or NaN (a run never writes one: NonFiniteWeights) would train on
    garbage: refused, on every process together."""
    if not weights_finite([p for p in policy.parameters() if p.requires_grad]):
        error = UsageError(f"{folder} holds non-finite weights: resume from an earlier checkpoint")
        error.agreed = True
        raise error


TRAINING_STATE = "training_state.pt"


def is_saved_model(folder: str) -> bool:
    """What save_pretrained writes: config.json and the weights (one file, or an index of shards), or a peft adapter."""

    def exists(*names):
        return all(os.path.isfile(os.path.join(folder, name)) for name in names)

    return (
        exists("config.json")
        and (exists("model.safetensors") or exists("model.safetensors.index.json"))
        or exists("adapter_config.json", "adapter_model.safetensors")
    )


def save_model(output_dir: str, policy, tokenizer, state_dict: Optional[dict] = None, merged: bool = False) -> None:
    """save_pretrained (of `state_dict`, the whole of a sharded policy, when given) by rank 0, checked: transformers
    only logs a warning when it cannot write the folder. A peft model saves its adapter, or with merged=True the
    transformers model with the adapter merged into its weights (merged_weights)."""
    if merged and state_dict is None:
        state_dict = dict(merged_weights(policy))
    model = transformers_model(policy) if merged else policy
    with agreed():
        if get_rank() == 0:
            try:
                model.save_pretrained(output_dir, state_dict=state_dict)
                tokenizer.save_pretrained(output_dir)
            except Exception as e:
                raise RunError(f"could not save the trained model to {output_dir} ({describe(e)})") from None
            if not is_saved_model(output_dir):
                raise RunError(
                    f"could not save the trained model to {output_dir}: config.json or the weights are "
                    "missing after save_pretrained"
                )


def save_outputs(output_dir: str, policy, tokenizer, merged_copy: bool, save: Optional[Callable] = None) -> None:
    """The trained model in output_dir (with --use_peft: its adapter) and, with merged_copy (--save_merged_model), the
    adapter merged into the weights in output_dir/merged. save: how a folder is saved (save_model; rloo_multigpu.py's
    sharded.save_sharded_model)."""
    save = save or save_model
    save(output_dir, policy, tokenizer)
    if merged_copy:
        save(os.path.join(output_dir, "merged"), policy, tokenizer, merged=True)


def save_policy(folder: str, policy, tokenizer) -> None:
    """The policy of a checkpoint: save_pretrained, so that a checkpoint is also a model."""
    policy.save_pretrained(os.path.join(folder, "policy"))
    tokenizer.save_pretrained(os.path.join(folder, "policy"))


def checkpoint_dirs(run_dir: str) -> list[str]:
    """The complete checkpoints of a run, oldest first (a save in progress is a tmp-checkpoint-<update> folder)."""
    folder = os.path.join(run_dir, "checkpoints")
    names = [
        n
        for n in (os.listdir(folder) if os.path.isdir(folder) else [])
        if re.fullmatch(r"checkpoint-\d+", n) and os.path.exists(os.path.join(folder, n, TRAINING_STATE))
    ]
    return [os.path.join(folder, n) for n in sorted(names, key=lambda n: int(n.split("-")[1]))]


def find_checkpoint(spec: str, run_name: Optional[str]) -> str:
    """The checkpoint --resume_from_checkpoint names: `latest` (in runs/<run_name>), a run folder (its newest), or a
    checkpoint folder; refused if a newer checkpoint of the same run exists, which resuming would overwrite."""
    given = f"--resume_from_checkpoint {spec}"
    if spec == "latest":
        if run_name is None:
            raise UsageError(
                "--resume_from_checkpoint latest needs --run_name (the run to continue is runs/<run_name>); "
                "or give the checkpoint folder"
            )
        spec, given = os.path.join("runs", run_name), f"{given} --run_name {run_name}"
    if not os.path.isdir(spec):
        raise UsageError(f"{spec} does not exist ({given})")
    path = os.path.abspath(spec)
    is_checkpoint = os.path.basename(os.path.dirname(path)) == "checkpoints"
    run_dir = os.path.dirname(os.path.dirname(path)) if is_checkpoint else spec
    found = checkpoint_dirs(run_dir)
    if not found:
        raise UsageError(
            f"{run_dir} has no complete checkpoint (checkpoints/checkpoint-<update>); a save that was "
            "interrupted leaves only a tmp-checkpoint-<update> folder"
        )
    if not is_checkpoint:
        return found[-1]
    if path not in found:
        raise UsageError(f"{spec} is not a complete checkpoint; the newest complete one is {found[-1]}")
    if path != found[-1]:
        raise UsageError(
            f"{run_dir} has a newer checkpoint, {found[-1]}, which resuming from {spec} would overwrite: "
            "resume from the newest, or move the newer ones away first"
        )
    return spec


def check_resumable(options: dict, checkpoint: str, resumable_changes: set[str]) -> None:
    """A resumed run is the run it continues: every option (options: this run's, by name) that changes what is computed
    must be the same as in the checkpoint's args.json (only the options in resumable_changes may differ). A checkpoint
    whose args.json lacks an option (of an earlier version of this project, or of another script) is continued by what
    wrote it."""
    path = os.path.join(checkpoint, "args.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        assert isinstance(saved, dict), "not a JSON object"
    except (OSError, ValueError, AssertionError) as e:
        raise UsageError(
            f"{path} is missing or damaged ({describe(e)}): move {checkpoint} away and resume again "
            "(`latest` then takes the checkpoint before it)"
        ) from None
    for name, value in json.loads(json.dumps(options)).items():
        if name not in saved and name not in resumable_changes:
            raise UsageError(
                f"{checkpoint} has no --{name} in its args.json: another script or an earlier version of "
                "this project wrote it; continue it with the one that did"
            )
        before = saved.get(name)
        if name == "dataset_name" and os.path.abspath(dataset_path(before)) == os.path.abspath(dataset_path(value)):
            continue  # the same dataset, by a relative or an absolute path
        if name not in resumable_changes and before != value:
            raise UsageError(
                f"--{name} is {value} here but {before} in {checkpoint}: resume with the options "
                f"the run was started with (only {', '.join(sorted(resumable_changes))} may change)"
            )


def load_training_state(checkpoint: str, run_dir: str, sharded: bool) -> dict:
    """The checkpoint's training state, and the files a resume needs besides it, checked before any model loads.
    sharded: the weights and optimizer state are torch.distributed.checkpoint shards in dcp/ (else a save_pretrained
    folder policy/, the optimizer state in the training state), written by as many processes as this run has."""
    damaged = f"move {checkpoint} away and resume again (`latest` then takes the checkpoint before it)"
    path = os.path.join(checkpoint, TRAINING_STATE)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        missing = {
            "update",
            "episode",
            "skipped_steps",
            "skipped_in_a_row",
            "seconds",
            "scheduler",
            "rng",
            "logger",
            *([] if sharded else ["optimizer"]),
        } - set(state)
        assert not missing, f"it lacks {', '.join(sorted(missing))}"
    except Exception as e:
        raise UsageError(f"{path} is damaged ({describe(e)}): {damaged}") from None
    if sharded and not os.path.isfile(os.path.join(checkpoint, "dcp", ".metadata")):
        raise UsageError(f"{os.path.join(checkpoint, 'dcp')} lacks its .metadata: {damaged}")
    if not sharded and not is_saved_model(os.path.join(checkpoint, "policy")):
        raise UsageError(f"{os.path.join(checkpoint, 'policy')} lacks config.json or its weights: {damaged}")
    if sharded and len(state["rng"]) != launch_world_size():
        raise UsageError(
            f"{checkpoint} was written by {len(state['rng'])} processes and this run has "
            f"{launch_world_size()}: resume with as many (torchrun --nproc_per_node ...)"
        )
    for name, size in state["logger"]["sizes"].items():
        log = os.path.join(run_dir, name)
        if not os.path.isfile(log) or os.path.getsize(log) < size:
            raise UsageError(
                f"{log} is {'shorter than at' if os.path.isfile(log) else 'missing since'} {checkpoint}, "
                "so the resumed run's log would have a hole: restore it, or start a new run from the "
                "checkpoint's weights"
            )
    return state


def rng_states() -> dict:
    """Every random number generator the run draws from: python, numpy, torch's CPU one and (sampling on GPU) CUDA's."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), position, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    kind, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if states["cuda"]:
        torch.cuda.set_rng_state_all(states["cuda"])


def rng_states_of_every_process() -> list[dict]:
    """rng_states() of each process, in rank order (a collective)."""
    states = [None] * get_world_size()
    dist.all_gather_object(states, rng_states())
    return states


def fsync(path: str) -> None:
    """Push a file (or a folder's entries) to the disk: a crash of the machine must not leave a renamed but empty
    checkpoint."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(checkpoint: str, save_weights: Callable[[str], None], options: dict, training_state: dict) -> None:
    """Write the weights (save_weights(folder), where every process takes part), the options (every option by name:
    args.json, which check_resumable reads back) and the training state into a temporary folder, then rename it:
    whenever a process dies, a checkpoint is complete or absent. A failed write is an error naming the path, and leaves
    the older checkpoints as they were. On several nodes the folder must be on a file system they share."""
    tmp = os.path.join(os.path.dirname(checkpoint), "tmp-" + os.path.basename(checkpoint))
    try:
        with agreed():
            if get_rank() == 0:
                os.makedirs(os.path.dirname(checkpoint), exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        save_weights(tmp)
        with agreed():
            if get_rank() == 0:
                with open(os.path.join(tmp, "args.json"), "w") as f:
                    json.dump(options, f, indent=2)
                torch.save(training_state, os.path.join(tmp, TRAINING_STATE))
                for root, _, files in os.walk(tmp):
                    for name in files:
                        fsync(os.path.join(root, name))
                os.rename(tmp, checkpoint)
                fsync(os.path.dirname(checkpoint))  # the rename itself
    except Exception as e:
        if get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        error = RunError(f"could not write checkpoint {checkpoint} ({describe(e)}); the earlier checkpoints are intact")
        error.agreed = True  # save_weights (a collective when sharded) and `agreed` raise on every process
        raise error from None


def resume_command(argv: list[str], checkpoint: str) -> str:
    """The command that continues this run: the same options, and --resume_from_checkpoint <checkpoint>, launched on
    as many processes (on several nodes, add the rendezvous options the run was launched with)."""
    kept, skip_value = [], False
    for arg in argv[1:]:
        if not skip_value and not arg.startswith("--resume_from_checkpoint"):
            kept.append(arg)
        skip_value = arg == "--resume_from_checkpoint"
    world_size, per_node = launch_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", launch_world_size()))
    launcher = (
        ["python"]
        if world_size == 1
        else ["torchrun", "--nproc_per_node", str(per_node)]
        + (["--nnodes", str(world_size // per_node)] if world_size > per_node else [])
    )
    return shlex.join([*launcher, argv[0], *kept, "--resume_from_checkpoint", checkpoint])


def run_dir_of(checkpoint: str) -> str:
    return os.path.relpath(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))))
