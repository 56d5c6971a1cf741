"""The options: a script's Args and its groups of options (each in its feature's module), parsed in sections of `--help`
(parse_args, paths with ~ expanded); the options a resumed run may change; each group's defaults that follow from other
options (derived_defaults). Their checks: checks.py."""

import contextlib
import functools
import io
import itertools
import os
import re
import signal
import sys
import time
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, make_dataclass, replace
from typing import Annotated, Optional

import tyro

from rloo_utils.checkpoints import CheckpointOptions
from rloo_utils.data import DataOptions
from rloo_utils.evaluation import EvaluationOptions
from rloo_utils.logs import LoggingOptions
from rloo_utils.lora import LoraOptions
from rloo_utils.models import Generator, ModelOptions, OldTrlOptions, SpeedOptions
from rloo_utils.generation import GenerationOptions
from rloo_utils.off_policy import ImportanceSamplingOptions
from rloo_utils.rewards import RewardSourceOptions
from rloo_utils.schedules import ScheduleOptions
from rloo_utils.tools import ToolUseOptions


@dataclass
class FeatureOptions(
    ModelOptions,
    DataOptions,
    RewardSourceOptions,
    GenerationOptions,
    LoraOptions,
    ToolUseOptions,
    EvaluationOptions,
    LoggingOptions,
    CheckpointOptions,
    ScheduleOptions,
    SpeedOptions,
    ImportanceSamplingOptions,
    OldTrlOptions,
    Generator,  # last: the vLLM groups derived from it (a script's Args lists them after this) then precede it alone
):
    """The options of the features, a group from each one's module: a script's Args adds the algorithm's own."""


def option_groups(args_class) -> list[type]:
    """The groups of options a script's Args is made of, beside its own: the dataclasses of rloo_utils' modules it
    derives from that declare options (a fork's Args, derived from a script's, has the script's as its own)."""
    return [
        c
        for c in args_class.__mro__
        if is_dataclass(c) and c.__module__.startswith("rloo_utils.") and vars(c).get("__annotations__")
    ]


def derived_defaults(args):
    """args with each group's defaults that follow from other options (its derived_defaults) filled in."""
    derived = {}
    for group in option_groups(type(args)):
        if "derived_defaults" in vars(group):
            derived.update(group.derived_defaults(args))
    return replace(args, **derived)


def resumable_options(args_class) -> set[str]:
    """The options a resumed run may change, none of which alters what it computes: the RESUMABLE of the script's Args
    and of each of its groups (and of a fork's Args)."""
    return set().union(*(vars(c).get("RESUMABLE", ()) for c in args_class.__mro__))


def own_fields(group) -> list:
    """The options a group declares itself, not those of a group it is built on (VLLMOptions on ServerOptions): each
    option has one section, its declaring group's."""
    declared = vars(group).get("__annotations__", {})
    return [f for f in fields(group) if f.name in declared]


def section(group):
    """A group as its section of `--help` parses it: its own options, those it inherits hidden (they are parsed in
    their own group's section, and a flag can be parsed in only one)."""
    own = {f.name for f in own_fields(group)}
    inherited = [f.name for f in fields(group) if f.name not in own]
    if not inherited:
        return group
    hidden = [(name, Annotated[Optional[object], tyro.conf.Suppress], None) for name in inherited]
    return make_dataclass(group.__name__, hidden, bases=(group,), namespace={"__doc__": group.__doc__})


def in_sections(args_class):
    """args_class as the command line shows it: its own options, then each group's own (own_fields) in a section of
    `--help` of its own, titled by the group's name and described by its docstring; every flag keeps its name (no
    prefix), and its default is the script's."""
    defaults = {f.name: f.default if f.default_factory is MISSING else f.default_factory() for f in fields(args_class)}
    spec = []
    for group in option_groups(args_class):
        names = [f.name for f in own_fields(group)]
        spec += [(name, Annotated[Optional[object], tyro.conf.Suppress], None) for name in names]  # not flat as well
        title = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", group.__name__.removesuffix("Options")).lower()
        view = section(group)
        group_defaults = functools.partial(view, **{name: defaults[name] for name in names})
        spec.append((group.__name__, Annotated[view, tyro.conf.arg(name=title)], field(default_factory=group_defaults)))
    return make_dataclass(args_class.__name__, spec, bases=(args_class,))


def flattened(parsed, args_class):
    """The Args of what in_sections(args_class) parsed: its own options and those of each group side by side."""
    values = {f.name: getattr(parsed, f.name) for f in fields(args_class)}
    for group in option_groups(args_class):
        values.update({f.name: getattr(getattr(parsed, group.__name__), f.name) for f in own_fields(group)})
    return args_class(**values)


def parse_args(args_class):
    """tyro's parser of a script's Args dataclass, its option groups in sections (in_sections), with its boxed parse
    error folded into one line (help and success are tyro's own); paths given with ~ expanded."""
    captured, view = io.StringIO(), in_sections(args_class)
    try:
        with contextlib.redirect_stderr(captured):
            args = flattened(tyro.cli(view, use_underscores=True, config=(tyro.conf.OmitArgPrefixes,)), args_class)
    except SystemExit as e:
        if not e.code:
            raise  # --help
        # Parse again, as wide as the message, so that no word of it is wrapped inside the box.
        wide, columns = io.StringIO(), os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "100000"
        try:
            with contextlib.redirect_stderr(wide):
                tyro.cli(view, use_underscores=True, config=(tyro.conf.OmitArgPrefixes,))
        except SystemExit:
            pass
        finally:
            if columns is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = columns
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip(" │") for line in wide.getvalue().splitlines()[1:]]
        box = itertools.takewhile(lambda line: not line or line.strip("─╰╯"), lines)  # up to the box's rule
        message = " ".join(line for line in box if line)
        rank = os.environ.get("RANK", "0")  # torchrun's; parsing comes before the process group
        if not (rank.isdigit() and int(rank) > 0):  # every process fails alike: rank 0 says it once for all
            print(
                f"{os.path.basename(sys.argv[0])}: error: {message or 'could not parse the options'} "
                f"(`python {sys.argv[0]} --help` lists them)",
                file=sys.stderr,
            )
        else:  # torchrun stops the other processes when one exits: rank 0 must have said it first (it exits at once)
            for stop in (signal.SIGTERM, signal.SIGINT):  # stopped meanwhile (torchrun, Ctrl-C): silently
                signal.signal(stop, signal.SIG_DFL)
            time.sleep(PARSE_ERROR_WAIT)
        sys.exit(2)  # argparse's status for a usage error
    sys.stderr.write(captured.getvalue())  # tyro's warnings, if any
    return expand_user_paths(args)


PARSE_ERROR_WAIT = 10  # seconds another process waits, after a parse error, for rank 0 to say it and exit


# Paths a user may write with ~ (expanded before anything else sees them)
PATH_OPTIONS = [
    "model_name_or_path",
    "sft_model_path",
    "dataset_name",
    "reward_model_path",
    "output_dir",
    "resume_from_checkpoint",
]


def expand_user_paths(args):
    expanded = {name: os.path.expanduser(getattr(args, name)) for name in PATH_OPTIONS if getattr(args, name)}
    if args.reward_funcs is not None:
        expanded["reward_funcs"] = [os.path.expanduser(spec) for spec in args.reward_funcs]
    return replace(args, **expanded)
