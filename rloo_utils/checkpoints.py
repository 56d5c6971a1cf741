"""Run folders, checkpoints and exact resume, and what a failure leaves behind: the run folder claimed and locked, the
output folder claimed, checkpoints written and found, the training state restored (random generators included), the
signals that stop a run after its update, and the rescue of a failed run (RunGuard, called by report_one_line_error)."""

import contextlib
import fcntl
import itertools
import json
import os
import random
import re
import shlex
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, ClassVar, Optional

import numpy as np
import torch
import torch.distributed as dist

from rloo_utils.data import dataset_path
from rloo_utils.errors import NonFiniteWeights, RunError, Terminated, UsageError, describe
from rloo_utils.lora import is_peft_model, merged_weights, trained_names, transformers_model
from rloo_utils.models import from_pretrained, weights_finite
from rloo_utils.processes import (
    agreed,
    background_working,
    end_processes,
    from_rank_0,
    get_rank,
    get_world_size,
    launch_world_size,
    max_over_processes,
)


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


def report_one_line_error(exc_type, exc, tb):
    """sys.excepthook: UsageError and RunError are one line; anything else keeps its traceback. Either way the run's
    guard first says what the failure leaves behind (RunGuard.on_failure), on the same line. An error every process
    raised together (`agreed`) is reported by rank 0 only; one of a single process, by that process."""
    together = getattr(exc, "agreed", False)
    after = RunGuard.active.on_failure(together, not issubclass(exc_type, NonFiniteWeights)) if RunGuard.active else ""
    where = "" if together or os.environ.get("WORLD_SIZE", "1") == "1" else f" (on rank {os.environ.get('RANK')})"
    if together and os.environ.get("RANK", "0") != "0":
        pass  # rank 0 reports it
    elif issubclass(exc_type, (UsageError, RunError)):
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}{where}{after}", file=sys.stderr)
    elif getattr(exc, "training", False):  # a second Ctrl-C or SIGTERM: the update is not waited for
        print(
            f"{os.path.basename(sys.argv[0])}: error: {signal.Signals(exc.signum).name} a second time: stopped at "
            f"once, without finishing the update{where}{after}",
            file=sys.stderr,
        )
    elif issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C or SIGTERM before training started
        print(
            f"{os.path.basename(sys.argv[0])}: error: interrupted before training started{where}{after}",
            file=sys.stderr,
        )
    elif issubclass(exc_type, dist.DistError) or "gloo/transport" in str(exc) or "ProcessGroupNCCL" in str(exc):
        # a collective failed (gloo raises a plain RuntimeError when the peer's socket closes): another process died
        print(
            f"{os.path.basename(sys.argv[0])}: error: another process stopped answering ({describe(exc)}){where}"
            f"{after}",
            file=sys.stderr,
        )
    else:
        sys.__excepthook__(exc_type, exc, tb)
        if after or where:
            print(f"{os.path.basename(sys.argv[0])}: error: {type(exc).__name__}{where}{after}", file=sys.stderr)
    if issubclass(exc_type, Terminated):  # else Python ends the process as on Ctrl-C, whatever the signal was
        sys.stderr.flush()
        os._exit(128 + exc.signum)
    if background_working():  # the interpreter's teardown could abort under it: exit at once (no collective here)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)


def stop_after_update_on_signals(console) -> list[int]:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler preempting the job) let the current update finish, then the run writes
    a checkpoint and exits. A second one (a scheduler's grace period ending, an update that cannot finish: a hung
    reward) stops it at once, and RunGuard still writes the checkpoint of the last complete update; a third ends the
    process as the signal does. Returns the list the signals go into."""
    received = []

    def request_stop(signum, frame):
        if received:
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_DFL)
            raise Terminated(signum, training=True)
        received.append(signum)
        console.print(
            f"{signal.Signals(signum).name}: finishing this update, then writing a checkpoint "
            "(send it again to stop now, keeping the checkpoint of the last complete update)"
        )

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    return received


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


LOCK_FILE = ".lock"  # in the run folder, locked by the one process that writes the run


OUTPUT_CLAIM = "rloo_run.json"  # in the output folder: the run folder whose model goes there


def claim_run_dir(args) -> str:
    """Create runs/<run_name>. os.mkdir fails when the folder exists, so runs started at the same moment never share
    one: an explicit --run_name that is taken is refused, a default one gets a suffix."""
    name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    try:
        os.makedirs("runs", exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"cannot create the runs folder in {os.getcwd()} ({describe(e)}): start rloo.py from a "
            "folder you can write to"
        ) from None
    for attempt in itertools.count(1):
        run_name = name if attempt == 1 else f"{name}_{attempt}"
        run_dir = os.path.join("runs", run_name)
        try:
            os.mkdir(run_dir)
            return run_dir
        except FileExistsError:
            if args.run_name is not None:
                raise UsageError(run_dir_taken(run_dir, run_name)) from None
        except OSError as e:
            raise UsageError(f"cannot create {run_dir} ({describe(e)})") from None


def run_dir_taken(run_dir: str, run_name: str) -> str:
    """The refusal of a run folder that exists, with advice that works for what the folder holds."""
    if checkpoint_dirs(run_dir):
        return (
            f"{run_dir} exists already: continue that run with --resume_from_checkpoint latest --run_name {run_name}, "
            "or choose another --run_name"
        )
    return (
        f"{run_dir} exists already and holds no checkpoint to continue from: choose another --run_name, or delete "
        f"{run_dir} to start that run again"
    )


def lock_run_dir(run_dir: str):
    """Lock the run folder for as long as this process lives (the kernel drops the lock however the process ends), so
    that a second process, e.g. a resume of a run that is still running, cannot write into it."""
    try:
        handle = open(os.path.join(run_dir, LOCK_FILE), "a+")
    except OSError as e:
        raise UsageError(f"cannot write to {run_dir} ({describe(e)})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        raise UsageError(
            f"{run_dir} is in use by another run (pid {handle.read().strip() or '?'}): wait "
            "for it to end, or choose another --run_name"
        ) from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def claim_output_dir(output_dir: str, run_dir: str) -> bool:
    """Reserve the folder the trained model will be saved to, before training: it must be new, empty, or this run's
    own (its rloo_run.json names this run folder), so nothing in it is overwritten; writing the claim proves that it
    is writable. Returns whether the folder was created here."""
    where = f"--output_dir {output_dir}"
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"{where} is a file, not a folder: give a folder for the trained model")
    claim, owner = os.path.join(output_dir, OUTPUT_CLAIM), os.path.abspath(run_dir)
    try:
        os.makedirs(output_dir)
        created = True
    except FileExistsError:
        created = False
    except OSError as e:
        raise UsageError(f"cannot create {where} ({describe(e)}): give a folder you can write to") from None
    if not created:
        try:
            with open(claim) as f:
                claimed_by = json.load(f)["run_dir"]
        except Exception:  # no claim (or not ours to read): only an empty folder may be taken
            claimed_by = None
        if claimed_by == owner:
            return False  # this run's own, from before a resume
        contents = sorted(os.listdir(output_dir))
        if contents == [OUTPUT_CLAIM] and claimed_by and not os.path.isdir(claimed_by):
            os.remove(claim)  # claimed by a run folder that has been deleted since
        elif contents:
            by = f" (claimed by {os.path.relpath(claimed_by)})" if claimed_by else ""
            raise UsageError(
                f"{where} is not empty{by}: it holds {', '.join(contents[:3])}{', ...' if len(contents) > 3 else ''}; "
                "give a new or empty folder, so that nothing in it is overwritten"
            )
    try:
        with open(claim, "x") as f:  # "x": fails if another run claimed the folder a moment ago
            json.dump({"run_dir": owner}, f)
    except FileExistsError:
        raise UsageError(f"{where} was claimed by another run a moment ago: give another folder") from None
    except OSError as e:
        raise UsageError(f"cannot write to {where} ({describe(e)}): give a folder you can write to") from None
    return created


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


def check_resumable(args, checkpoint: str, resumable_changes: set[str]) -> None:
    """A resumed run is the run it continues: every option that changes what is computed must be the same (only the
    options in resumable_changes may differ). A checkpoint whose args.json lacks an option (of an earlier version of
    this project, or of another script) is continued by what wrote it."""
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
    for name, value in json.loads(json.dumps(asdict(args))).items():
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


def save_checkpoint(checkpoint: str, save_weights: Callable[[str], None], args, training_state: dict) -> None:
    """Write the weights (save_weights(folder), where every process takes part), the options and the training state
    into a temporary folder, then rename it: whenever a process dies, a checkpoint is complete or absent. A failed
    write is an error naming the path, and leaves the older checkpoints as they were. On several nodes the folder
    must be on a file system they share."""
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
                    json.dump(asdict(args), f, indent=2)
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


@dataclass
class Progress:
    """Where a run is after its last complete update: with the weights, the optimizer and scheduler states, the random
    generators and where the logs end, what a checkpoint holds."""

    update: int = 0
    episode: int = 0  # completions trained on
    num_tokens: int = 0  # prompt and completion tokens trained on (TRL 1.16)
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    skipped_in_a_row: int = 0
    start_time: float = 0.0  # time.time() at the run's start, as if it had never stopped


class RunGuard:
    """Checkpoints, resume, signals, and what a failure leaves behind: the training loop calls start() before it and
    update_done() at the end of each update. A run that has trained nothing removes the folders it created, so that the
    same command can simply be run again. A run that has trained writes a checkpoint before it exits, so that nothing it
    learned is lost, and its error ends with the command that continues it. report_one_line_error (sys.excepthook)
    calls on_failure."""

    active: Optional["RunGuard"] = None

    def __init__(self, args, run_dir: str, created: list[str], batch_size: int, training_state: Optional[dict]):
        self.args, self.run_dir, self.created, self.batch_size = args, run_dir, created, batch_size
        self.training_state = training_state  # of the checkpoint the run resumes from (None: a new run)
        self.watching, self.state = False, None
        RunGuard.active = self

    def start(
        self,
        save_weights: Callable[[str], None],
        stateful: dict,
        logger,
        console,
        num_updates: int,
        closing: tuple = (),
    ) -> Progress:
        """Where the training loop starts: a resumed run's `stateful` objects (optimizer, scheduler) and random
        generators restored, and its counters returned. From here on Ctrl-C and SIGTERM stop the run after its update
        (update_done), and a failure writes a checkpoint. save_weights(folder): the weights (and the optimizer state,
        if not in `stateful`); stateful: the objects whose state_dict() a checkpoint holds, the "scheduler" among
        them; closing: what a stop closes besides the logger."""
        saved = self.training_state
        progress = Progress(start_time=time.time())
        if saved is not None:
            progress = Progress(
                saved["update"],
                saved["episode"],
                saved["num_tokens"],
                saved["skipped_steps"],
                saved["skipped_in_a_row"],
                time.time() - saved["seconds"],
            )
            for name, stateful_object in stateful.items():
                stateful_object.load_state_dict(saved[name])
            set_rng_states(saved["rng"][get_rank()] if isinstance(saved["rng"], list) else saved["rng"])
        self.save_weights, self.stateful, self.logger, self.console = save_weights, stateful, logger, console
        self.num_updates, self.closing = num_updates, closing
        self.stop_signals = stop_after_update_on_signals(console)
        self.watching, self.first_update = True, progress.update
        self.record(progress)
        return progress

    def optimizer_steps(self) -> int:
        return self.stateful["scheduler"].last_epoch  # the scheduler counts optimizer steps

    def record(self, progress: Progress) -> None:
        """The training state after a complete update (all a checkpoint holds but `stateful`): what a failure keeps."""
        self.steps_at_state = self.optimizer_steps()
        state = {k: v for k, v in asdict(progress).items() if k != "start_time"}
        every_process = dist.is_initialized()  # rloo_multigpu.py: the generators of each process, in rank order
        self.state = {
            **state,
            "seconds": time.time() - progress.start_time,
            "logger": self.logger.state(),
            "rng": rng_states_of_every_process() if every_process else rng_states(),
        }

    def update_done(self, progress: Progress) -> None:
        """At the end of an update: a checkpoint every --save_steps updates, and before the run stops on Ctrl-C or
        SIGTERM (exit status 128 + the signal, as a shell reports one) or on too many skipped steps (one line).
        Every process takes the same decisions together."""
        self.record(progress)
        stop = max_over_processes(self.stop_signals[0] if self.stop_signals else 0)  # any process's signal
        if (self.args.save_steps and progress.update % self.args.save_steps == 0) or stop:
            save_start = time.perf_counter()
            saved = self.save()
            self.console.print(f"wrote {saved} in {time.perf_counter() - save_start:.2f} s")
        with agreed():  # every process has the same count: they stop together
            num_optimizer_steps = self.num_updates * self.args.num_ppo_epochs * self.args.num_mini_batches
            check_skipped_steps(
                progress.skipped_in_a_row, self.args.max_skipped_steps, progress.update, num_optimizer_steps
            )
        if stop:
            for opened in (self.logger, *self.closing):
                opened.close()
            if get_rank() == 0:
                print(stopped_message(stop, progress.update, self.num_updates, saved), flush=True)
            RunGuard.active = None  # stopped as asked: nothing to rescue
            if dist.is_initialized() or background_working():
                end_processes(128 + stop)
            sys.exit(128 + stop)

    def finished(self) -> None:
        """The trained model is saved: nothing left to rescue."""
        RunGuard.active = None

    def save(self, state: Optional[dict] = None) -> str:
        """Write the checkpoint of `state` (default: the last complete update); keep the newest --save_total_limit."""
        state = state or self.state
        path = os.path.join(self.run_dir, "checkpoints", f"checkpoint-{state['update']}")
        save_checkpoint(
            path, self.save_weights, self.args, {**state, **{k: v.state_dict() for k, v in self.stateful.items()}}
        )
        if self.args.save_total_limit and get_rank() == 0:
            for old in checkpoint_dirs(self.run_dir)[: -self.args.save_total_limit]:
                shutil.rmtree(old)
        return path

    def on_failure(self, together: bool, weights_kept: bool = True) -> str:
        """Called once, for the error that ends the run; returns the end of its error line. together: every process
        raised it at the same point (`agreed`), so that they can write a checkpoint together. weights_kept False: the
        weights in memory are broken (NonFiniteWeights) and only an earlier checkpoint holds any worth keeping."""
        RunGuard.active = None
        stepped = self.watching and self.optimizer_steps() != self.steps_at_state  # the weights may have moved
        found = checkpoint_dirs(self.run_dir) if self.watching else []
        if not weights_kept and found:
            return (
                f"; nothing of this update was saved; the newest checkpoint is {found[-1]}; continue with: "
                f"{resume_command(sys.argv, found[-1])}"
            )
        if not self.watching or not weights_kept or not stepped and self.state["update"] == self.first_update:
            # nothing new was trained, or nothing worth keeping
            if get_rank() == 0:
                for path in self.created:
                    shutil.rmtree(path, ignore_errors=True)
            return "" if weights_kept else "; nothing was saved"
        if not together and get_world_size() > 1:  # the other processes are elsewhere: none can help to save
            return (
                f"; every process stops; the newest checkpoint is {found[-1]}; continue with: "
                f"{resume_command(sys.argv, found[-1])}"
                if found
                else "; every process stops (no checkpoint yet)"
            )
        state = self.state
        if stepped:  # cut short inside an update: keep what it did, as the next update
            every_process = isinstance(state["rng"], list)
            state = {
                **state,
                "update": state["update"] + 1,
                "episode": state["episode"] + self.batch_size,
                "rng": rng_states_of_every_process() if every_process else rng_states(),
                "logger": self.logger.state(),
            }
        path = os.path.join(self.run_dir, "checkpoints", f"checkpoint-{state['update']}")
        if not os.path.isdir(path):
            try:
                self.save(state)
            except RunError as e:
                return f"; saving what it trained failed too: {e}"
        with contextlib.suppress(Exception):
            self.logger.close(failed=True)
        where = (
            f"update {state['update']} was cut short: the weights and optimizer state it reached are in {path} (a "
            "resumed run goes on from them, but is not the run that never failed)"
            if stepped
            else f"the state after update {state['update']} is in {path}"
        )
        return f"; {where}; continue with: {resume_command(sys.argv, path)}"


def resume_point(args, resumable_changes: set[str], sharded: bool = False) -> tuple[Optional[str], Optional[dict]]:
    """The checkpoint --resume_from_checkpoint names and its training state, checked (None, None: a new run)."""
    if args.resume_from_checkpoint is None:
        return None, None
    checkpoint = find_checkpoint(args.resume_from_checkpoint, args.run_name)
    check_resumable(args, checkpoint, resumable_changes)
    return checkpoint, load_training_state(checkpoint, run_dir_of(checkpoint), sharded)


def run_dir_of(checkpoint: str) -> str:
    return os.path.relpath(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))))


def claim_run(
    args, checkpoint: Optional[str], training_state: Optional[dict], batch_size: int
) -> tuple[str, str, RunGuard]:
    """The run folder (a new runs/<run_name>, or the checkpoint's), locked for as long as this process lives against a
    second run; the folder the trained model goes to, reserved; and the RunGuard that from here on removes what this
    run created if it fails before training, or leaves a checkpoint once it has trained. Returns (run folder, output
    folder, guard). Rank 0 claims the folders and tells the others."""
    run_dir = lock = None
    with agreed():
        if get_rank() == 0:
            run_dir = run_dir_of(checkpoint) if checkpoint else claim_run_dir(args)
            lock = lock_run_dir(run_dir)
            if checkpoint:  # the run may have gone on, and ended, between finding its newest checkpoint and the lock
                find_checkpoint(checkpoint, None)
    run_dir = from_rank_0(run_dir)
    guard = RunGuard(args, run_dir, [] if checkpoint else [run_dir], batch_size, training_state)
    guard.lock = lock  # held (open) until the process ends
    output_dir = args.output_dir or os.path.join(run_dir, "model")
    with agreed():
        if get_rank() == 0 and claim_output_dir(output_dir, run_dir):
            guard.created.append(output_dir)
    return run_dir, output_dir, guard


def check_skipped_steps(skipped_in_a_row: int, max_skipped_steps: int, update: int, num_optimizer_steps: int) -> None:
    """Too many skipped steps in a row stop the run; so does a run shorter than that whose every step was skipped,
    which trained nothing and must not end as if it had."""
    if skipped_in_a_row >= min(max_skipped_steps, num_optimizer_steps):
        raise RunError(
            f"{skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient (update {update}): "
            "stopping rather than training on garbage (check the rewards; a new run can start from the "
            "weights of the checkpoint before with a lower --learning_rate)"
        )


def stopped_message(signum: int, update: int, num_updates: int, checkpoint: str) -> str:
    return (
        f"stopped by {signal.Signals(signum).name} after update {update} of {num_updates}; checkpoint {checkpoint}. "
        f"Continue the run with:\n  {resume_command(sys.argv, checkpoint)}"
    )
