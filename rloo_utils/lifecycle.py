"""A run's life, from its start to what its end leaves behind: the one-line error of a failure (sys.excepthook), the
signals that stop it after its update, its folders claimed before it trains (runs/<run_name> created and locked, the
output folder reserved), where it is after each update (Progress), and RunGuard, which restores a resumed run's state,
writes its checkpoints while it trains and, when it fails, removes the folders of a run that trained nothing or saves
what it trained. The checkpoint files themselves are checkpoints.py's."""

import contextlib
import fcntl
import itertools
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch.distributed as dist

from rloo_utils.checkpoints import (
    checkpoint_dirs,
    find_checkpoint,
    resume_command,
    rng_states,
    rng_states_of_every_process,
    run_dir_of,
    save_checkpoint,
    set_rng_states,
)
from rloo_utils.errors import NonFiniteWeights, RunError, Terminated, UsageError, describe
from rloo_utils.processes import (
    agreed,
    background_working,
    end_processes,
    from_rank_0,
    get_rank,
    get_world_size,
    max_over_processes,
)


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


LOCK_FILE = ".lock"  # in the run folder, locked by the one process that writes the run


OUTPUT_CLAIM = "rloo_run.json"  # in the output folder: the run folder whose model goes there


def claim_run_dir(*, run_name: Optional[str], exp_name: str, seed: int) -> str:
    """Create runs/<run_name> (--run_name; None: <exp_name>__<seed>__<unix time>, of the script and --seed). os.mkdir
    fails when the folder exists, so runs started at the same moment never share one: an explicit run_name that is
    taken is refused, a default one gets a suffix."""
    name = run_name or f"{exp_name}__{seed}__{int(time.time())}"
    try:
        os.makedirs("runs", exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"cannot create the runs folder in {os.getcwd()} ({describe(e)}): start rloo.py from a "
            "folder you can write to"
        ) from None
    for attempt in itertools.count(1):
        candidate = name if attempt == 1 else f"{name}_{attempt}"
        run_dir = os.path.join("runs", candidate)
        try:
            os.mkdir(run_dir)
            return run_dir
        except FileExistsError:
            if run_name is not None:
                raise UsageError(run_dir_taken(run_dir, candidate)) from None
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

    def count_step(self, stepped: bool) -> None:
        """An optimizer step taken, or skipped (non-finite): skipped ones are counted, in all and in a row."""
        self.skipped_steps += not stepped
        self.skipped_in_a_row = 0 if stepped else self.skipped_in_a_row + 1

    def advance(self, update: int, completions: int, tokens: int) -> None:
        """`update` done, on that many completions of that many prompt and completion tokens."""
        self.update, self.episode, self.num_tokens = update, self.episode + completions, self.num_tokens + tokens


class RunGuard:
    """Checkpoints, resume, signals, and what a failure leaves behind: the training loop calls start() before it and
    update_done() at the end of each update. A run that has trained nothing removes the folders it created, so that the
    same command can simply be run again. A run that has trained writes a checkpoint before it exits, so that nothing it
    learned is lost, and its error ends with the command that continues it. report_one_line_error (sys.excepthook)
    calls on_failure."""

    active: Optional["RunGuard"] = None

    def __init__(
        self,
        run_dir: str,
        created: list[str],
        batch_size: int,
        training_state: Optional[dict],
        *,
        options: dict,
        save_steps: int,
        save_total_limit: Optional[int],
        max_skipped_steps: int,
        steps_per_update: int,
    ):
        """run_dir: the run's folder; created: the folders a failure before training removes; batch_size: the
        completions of an update (what a cut-short update adds to the episodes); training_state: of the checkpoint the
        run resumes from (None: a new run). options: every option by name, each checkpoint's args.json; a checkpoint
        every save_steps updates (0: only when stopped), the newest save_total_limit kept (None: all); the run stops
        after max_skipped_steps skipped optimizer steps in a row, of steps_per_update an update."""
        self.run_dir, self.created, self.batch_size = run_dir, created, batch_size
        self.training_state = training_state  # of the checkpoint the run resumes from (None: a new run)
        self.options, self.save_steps, self.save_total_limit = options, save_steps, save_total_limit
        self.max_skipped_steps, self.steps_per_update = max_skipped_steps, steps_per_update
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
        if (self.save_steps and progress.update % self.save_steps == 0) or stop:
            save_start = time.perf_counter()
            saved = self.save()
            self.console.print(f"wrote {saved} in {time.perf_counter() - save_start:.2f} s")
        with agreed():  # every process has the same count: they stop together
            num_optimizer_steps = self.num_updates * self.steps_per_update
            check_skipped_steps(progress.skipped_in_a_row, self.max_skipped_steps, progress.update, num_optimizer_steps)
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
            path, self.save_weights, self.options, {**state, **{k: v.state_dict() for k, v in self.stateful.items()}}
        )
        if self.save_total_limit and get_rank() == 0:
            for old in checkpoint_dirs(self.run_dir)[: -self.save_total_limit]:
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


def claim_run(args, plan, batch_size: int) -> tuple[str, str, RunGuard]:
    """The run folder (a new runs/<run_name>, claim_run_dir's, or the checkpoint's), locked for as long as this process
    lives against a second run; the folder the trained model goes to (output_dir, --output_dir; None: the run folder's
    model/), reserved; and the RunGuard that from here on removes what this run created if it fails before training,
    or leaves a checkpoint once it has trained (the run's options, --save_steps, --save_total_limit and
    --max_skipped_steps; batch_size; plan: set_up.RunPlan, its checkpoint and training_state, the resumed run's, None
    for a new run). Reads the run's names and folders (--run_name, --exp_name, --seed, --output_dir). Returns (run
    folder, output folder, guard). Rank 0 claims the folders and tells the others."""
    checkpoint, training_state = plan.checkpoint, plan.training_state
    run_dir = lock = None
    with agreed():
        if get_rank() == 0:
            run_dir = (
                run_dir_of(checkpoint)
                if checkpoint
                else claim_run_dir(run_name=args.run_name, exp_name=args.exp_name, seed=args.seed)
            )
            lock = lock_run_dir(run_dir)
            if checkpoint:  # the run may have gone on, and ended, between finding its newest checkpoint and the lock
                find_checkpoint(checkpoint, None)
    run_dir = from_rank_0(run_dir)
    guard = RunGuard(
        run_dir,
        [] if checkpoint else [run_dir],
        batch_size,
        training_state,
        options=plan.options,
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        max_skipped_steps=args.max_skipped_steps,
        steps_per_update=args.num_ppo_epochs * args.num_mini_batches,
    )
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
