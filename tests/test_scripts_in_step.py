"""The scripts repeat the algorithm on purpose, so that each stands alone; this keeps what they share identical.

Every top-level function, class and constant defined in more than one script must have the same source in each (a class
method by method: the loop's seams share what they can), except the intended differences named below, each with its
reason. A fix in one script is then a fix in all of them.
"""

import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, SCRIPTS

INTENDED_DIFFERENCES = {
    "Args": "rloo_vllm.py adds the --vllm_* options; rloo_multigpu.py --fsdp_cpu_offload, --ddp_timeout and the server's",
    "main": "compared hunk by hunk below (INTENDED_IN_MAIN)",
    "completion_logprobs": "the vLLM scripts: also the log-probs renormalised over the tokens vLLM could draw (support)",
    "tokens_in_loss": "rloo_multigpu.py: each process holds its rows of a minibatch; a token-mean divides by all",
}


# main() is the driver, and differs by design; but only where a script's concern is: each line of its difference from
# rloo.py's main(), compared after ast.unparse (comments and layout aside), must hold one of these fragments, each with
# its reason, and each fragment must explain a line. Any other difference is an accident: mend it in every script.
INTENDED_IN_MAIN = {
    "rloo_vllm.py": {
        "seeds_for(update, 0,": "a seed per completion, as the queue's requests have: what a resumed run samples again",
        "with timer('generation')": "the queue's rollouts (--max_staleness) beside the default ones",
        "else:": "the queue's rollouts (--max_staleness)",
        "data.repeated(next(batches)": "the queue draws each update's prompts (the sampler's request)",
        "check_vllm_args(": "the vLLM options are checked with the others, before anything loads",
        "VLLMServer(": "--vllm_mode server: the server's client, made before the models load (it checks the server)",
        "Sampler.for_run(": "vLLM's sampler (vllm_sampling.py): an engine in this process, or the server made first",
        "engine": "vLLM's engine: made, sent the policy's weights after each update, checked, put to sleep, closed",
        "support": "the trainer's log-probs also on vLLM's distribution (renormalised over the tokens it could draw)",
        "trainer_sampling_logprobs": "the correction compares vLLM's log-probs with the trainer's on that distribution",
        "logprobs = packing.rollout_logprobs(": "the trainer's log-probs also on vLLM's distribution",
        "off_policy.correction(old_logprobs": "the correction compares vLLM's log-probs with the trainer's",
        "sampling_metrics(old_logprobs": "the gap between vLLM's log-probs and the trainer's on its distribution",
        "is_correction": "vLLM's samples are always corrected (--importance_sampling_correction)",
        "importance_sampling_correction": "vLLM's samples are always corrected (--importance_sampling_correction)",
        "queue": "the rollouts come from the queue (with --max_staleness sampled ahead), which a checkpoint keeps",
        "{'optimizer': optimizer": "a checkpoint also keeps the queue's rollouts",
        "'scheduler': scheduler": "a checkpoint also keeps the queue's rollouts",
        "sampler.sample(prompts, columns, generation_config)": "the rollout of the queue's prompts, seeds and outputs",
        "generation_seconds": "with --max_staleness the generation's seconds are the queue's",
        "'perf/generated_tokens_per_second'": "with --max_staleness the generation's seconds are the queue's",
        "'async/": "the queue's metrics",
        "'perf/weight_sync_bytes'": "the size of the weight push",
        "stateful": "a checkpoint also keeps the queue's rollouts",
        "args.max_staleness": "the queue: the server finishes the rollouts of older weights before the weights change",
        "timer('generation_wait')": "the queue: the server finishes the rollouts of older weights first",
    },
    "rloo_multigpu.py": {
        "else:": "the queue's rollouts (--max_staleness)",
        "seeds_for(update, 0,": "a seed per completion, as the queue's requests have: what a resumed run samples again",
        "with timer('generation')": "the queue's rollouts (--max_staleness) beside the default ones",
        "data.repeated(next(batches)": "the queue draws each update's prompts (the sampler's request)",
        "launch_world_size(": "the process group, formed first: every check is agreed by every process",
        "init_processes(": "the process group, formed first: every check is agreed by every process",
        "sys.excepthook": "every process reports its failure in one line",
        "agreed()": "what fails on one process stops every process",
        "world_size": "each process its share of the batch, its prompts, its shards",
        "rank": "each process its own random streams, rows and console",
        "seed": "each process its own random streams",
        "checks.check_args(args": "the checks run under agreed(): every process stops on bad input",
        "check_algorithm(args)": "the checks run under agreed()",
        "resolve_defaults(args)": "the checks run under agreed()",
        "set_up.plan_run(args": "the plan, sharded",
        "torch.device(": "each process its own GPU (init_processes)",
        "set_up_cuda(": "set up before the process group's first CUDA call",
        "autocast =": "FSDP's mixed precision computes in bfloat16, not autocast",
        "Console(": "one console: rank 0 prints",
        "load_models(": "the models loaded sharded",
        "load_sharded_models(": "the models loaded sharded",
        "load_sharded_checkpoint(": "a resumed run's sharded weights and optimizer",
        "shaped_scores(": "over the whole batch, gathered: a check that fails stops every process",
        "Sampler.for_run(": "the sharded policy's sampler, or a server's made first (sharded_sampling.py)",
        "server": "a vLLM server may generate (--vllm_server_host): its client, configs, checks and weight pushes",
        "support": "the trainer's log-probs also on a server's distribution (renormalised over the tokens it could draw)",
        "trainer_sampling_logprobs": "the correction compares a server's log-probs with the trainer's on its distribution",
        "is_correction": "a server's samples are corrected; the trainer's log-probs on its distribution",
        "logprobs = packing.rollout_logprobs(": "the trainer's log-probs also on a server's distribution",
        "off_policy.correction(old_logprobs": "the correction compares a server's log-probs with the trainer's",
        "sampling_metrics(old_logprobs": "the gap between a server's log-probs and the trainer's on its distribution",
        "Scorer.for_run(": "a sharded reward model",
        "open_logger(": "the logger opened by every process (rank 0 writes)",
        "first_line(": "the first line names the processes",
        "queue": "the rollouts come from the queue (a server's, with --max_staleness, sampled ahead)",
        "stateful": "sharded checkpoints: the optimizer with the weights; the queue's rollouts",
        "{'optimizer': optimizer": "sharded checkpoints: the optimizer with the weights",
        "'scheduler': scheduler": "sharded checkpoints: the optimizer with the weights; the queue's rollouts",
        "save_policy": "sharded checkpoints",
        "save_sharded_checkpoint": "sharded checkpoints",
        "prompt_batches(": "each process its own prompts",
        "sampler.sample(prompts, columns, generation_config)": "the rollout of the queue's prompts, seeds and outputs",
        "mask = rollout.policy_mask": "a process's rows, then the batch's",
        "ref_policy": "a sharded reference is resharded after its forward",
        "reshard(": "a sharded reference is resharded after its forward",
        "rollouts.gather_rollout(": "every process's rows gathered: the baselines need every group",
        "gather_rows(": "every process's rows gathered: the baselines need every group",
        "all_reduce(": "over every process",
        "own_rows": "each process trains on its own rows of each minibatch",
        "local_": "each process's share of the batch and of a minibatch",
        "mb_start + mini_batch_size": "each process's share of a minibatch",
        "torch.randperm(batch_size": "each process's share of the batch",
        "range(0, batch_size, mini_batch_size)": "each process's share of the batch",
        "max_over_processes": "every process runs as many micro-batches (FSDP's collectives)",
        "images_batch(rollout.images, idx,": "a process's images are its own rows'",
        "stats.metrics(": "the statistics of every process's micro-batches",
        "tool_counts": "tool calls over every process",
        "args.max_staleness": "the queue: a server finishes the rollouts of older weights before the weights change",
        "generation_seconds": "with --max_staleness the generation's seconds are the queue's",
        "'perf/generated_tokens_per_second'": "with --max_staleness the generation's seconds are the queue's",
        "'async/": "the queue's metrics",
        "checkpoints.save_outputs(": "the trained model gathered from its shards",
        "end_processes(": "the process group ends",
        "timer('reward')": "a reward function that fails on one process stops every process",
        "packing.micro_batches(": "every process runs as many micro-batches (FSDP's collectives)",
        "plan.checkpoint": "a resumed run's sharded weights and optimizer",
    },
}


def unparsed_lines(script: str, name: str) -> list[str]:
    """A definition after ast.unparse, a dict literal's entries a line each (the metrics of an update are one dict)."""
    lines = ast.unparse(ast.parse(DEFINITIONS[script][name])).splitlines()
    return [part for line in lines if line.strip() for part in re.split(r", (?='[\w/]+': |\*\*)", line)]


def differing_lines(script: str, name: str) -> list[str]:
    """The lines of a definition in `script` and in rloo.py that are not in both (rloo.py's marked -, the script's +)."""
    import difflib

    a, b = unparsed_lines("rloo.py", name), unparsed_lines(script, name)
    opcodes = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return [f"- {line}" for tag, i1, i2, _, _ in opcodes if tag != "equal" for line in a[i1:i2]] + [
        f"+ {line}" for tag, _, _, j1, j2 in opcodes if tag != "equal" for line in b[j1:j2]
    ]


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s != "rloo.py"])
def test_main_differs_from_rloo_py_only_where_its_concern_is(script):
    lines = differing_lines(script, "main")
    assert lines, "main() is the same as rloo.py's: this guard would pass vacuously"
    explains = {fragment: [line for line in lines if fragment in line] for fragment in INTENDED_IN_MAIN[script]}
    unexplained = [line for line in lines if not any(fragment in line for fragment in explains)]
    assert not unexplained, (
        f"main() of {script} differs from rloo.py's where no intended difference says why (mend it in every script, "
        "or name it in INTENDED_IN_MAIN with its reason):\n" + "\n".join(unexplained)
    )
    stale = [fragment for fragment, found in explains.items() if not found]
    assert not stale, f"these intended differences of {script}'s main() explain no difference: take them off: {stale}"


def top_level_definitions(script: str) -> dict[str, str]:
    """name -> source of each top-level def, class and NAME = ... assignment; a class's methods as Class.method, the
    class itself as the rest of its body (docstring, fields)."""
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    definitions = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
            rest = [ast.get_source_segment(source, n) for n in node.body if n not in methods]
            definitions[node.name] = "\n".join(
                [f"class {node.name}", *[ast.unparse(d) for d in node.decorator_list], *rest]
            )
            for method in methods:
                definitions[f"{node.name}.{method.name}"] = ast.get_source_segment(source, method)
        elif isinstance(node, ast.FunctionDef):
            definitions[node.name] = ast.get_source_segment(source, node)
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            for target in node.targets:
                definitions[target.id] = ast.get_source_segment(source, node)
    return definitions


DEFINITIONS = {script: top_level_definitions(script) for script in SCRIPTS}
SHARED = sorted(
    {name for a in SCRIPTS for b in SCRIPTS if a < b for name in DEFINITIONS[a].keys() & DEFINITIONS[b].keys()}
)


def test_the_scripts_share_the_algorithm():
    assert len(SCRIPTS) >= 2 and len(SHARED) > 20  # this guard would pass vacuously on scripts that share nothing
    for name in ["rloo_advantages", "policy_loss", "completion_logprobs", "per_token_kl", "main"]:
        assert name in SHARED


@pytest.mark.parametrize("name", [n for n in SHARED if n not in INTENDED_DIFFERENCES])
def test_a_shared_definition_is_identical_in_every_script(name):
    sources = {script: DEFINITIONS[script][name] for script in SCRIPTS if name in DEFINITIONS[script]}
    first_script, first = next(iter(sources.items()))
    for script, source in sources.items():
        assert source == first, (
            f"{name} differs between {first_script} and {script}: make the fix in every script, or "
            "name the difference in INTENDED_DIFFERENCES with its reason"
        )


@pytest.mark.parametrize("name", sorted(INTENDED_DIFFERENCES))
def test_every_intended_difference_is_real(name):
    """The list stays short and true: a name listed here really differs somewhere."""
    sources = {DEFINITIONS[script][name] for script in SCRIPTS if name in DEFINITIONS[script]}
    assert len(sources) > 1, f"{name} is the same in every script: take it off INTENDED_DIFFERENCES"


STAGES = ["# Rollout", "# Reward", "# KL", "# Advantage", "# Update", "# Logging", "# Checkpoint", "# ---- Output"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_loop_reads_as_the_algorithm_in_every_script(script):
    """main() holds the stages of an update in one order, under the same names, in every script."""
    main = DEFINITIONS[script]["main"]
    positions = [main.find(stage) for stage in STAGES]
    assert -1 not in positions and positions == sorted(positions), dict(zip(STAGES, positions))


PLUMBING = sorted(name for name in os.listdir(os.path.join(ROOT, "rloo_utils")) if name.endswith(".py"))


def test_the_plumbing_lives_once_and_knows_no_script():
    """rloo_utils/ defines what no script repeats, each definition once, and imports no script: a script passes in what
    differs."""
    definitions = {}
    for module in PLUMBING:
        with open(os.path.join(ROOT, "rloo_utils", module)) as f:
            tree = ast.parse(f.read())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {name for name in imported if name and name.split(".")[0] in {s[:-3] for s in SCRIPTS}}, module
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                assert node.name not in definitions, (
                    f"{node.name} is defined in {definitions.get(node.name)} and {module}"
                )
                definitions[node.name] = module
    assert len(definitions) > 150  # this guard would pass vacuously on a folder it cannot read
    for script in SCRIPTS:
        again = definitions.keys() & DEFINITIONS[script].keys()
        assert not again, f"{script} defines again what rloo_utils/ holds: {sorted(again)}"


# What rloo.py's reader may meet: no vLLM, no sharding. What each script imports, in a fresh interpreter.
NOT_IMPORTED = {
    "rloo.py": (
        "vllm",
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
        "rloo_utils.sharded",
        "rloo_utils.vllm_",
        "rloo_utils.weight_transfer",
    ),
    "rloo_vllm.py": ("torch.distributed.fsdp", "rloo_utils.sharded"),
    "rloo_multigpu.py": ("vllm",),
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_imports_only_the_plumbing_it_uses(script):
    """Importing rloo.py loads no vLLM and no FSDP code, neither theirs nor ours; rloo_vllm.py no FSDP; rloo_multigpu.py
    no vLLM (a server's client is HTTP and NCCL)."""
    code = (
        f"import sys; import {script[:-3]}; "
        f"print(' '.join(m for m in sys.modules if m.startswith({NOT_IMPORTED[script]!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [], f"importing {script} loads {result.stdout.split()}"


# What a script adds to rloo.py, each with its reason: with INTENDED_DIFFERENCES, these are all that tell it apart, so that
# `diff rloo.py <script>` shows generation and weight sync, or the process group, sharding and reductions.
# What a script defines beside rloo.py's definitions, each with its reason: nothing; each script's sampler (its
# generation and weight sync) is in rloo_utils (rollouts.HFSampler, vllm_sampling.VLLMSampler, sharded_sampling.py)
ADDED: dict[str, dict[str, str]] = {}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_adds_to_rloo_py_only_its_own_concern(script):
    """A design check: everything rloo.py defines is in every script, and a script adds only what ADDED names."""
    assert not DEFINITIONS["rloo.py"].keys() - DEFINITIONS[script].keys(), f"{script} lacks a definition of rloo.py"
    new = DEFINITIONS[script].keys() - DEFINITIONS["rloo.py"].keys()
    added = {name for name in new if "." not in name or name.split(".")[0] not in new}  # a new class brings its methods
    assert added == ADDED.get(script, {}).keys(), (
        f"{script} adds {sorted(added - ADDED.get(script, {}).keys())} "
        f"and no longer has {sorted(ADDED.get(script, {}).keys() - added)}: "
        "name each addition in ADDED with its reason, or move it to rloo_utils/"
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_reader_reaches_the_loop_before_three_quarters_of_the_file(script):
    """The algorithm first: Args, the small functions of the algorithm, then main() with its loop; the rest after."""
    with open(os.path.join(ROOT, script)) as f:
        lines = f.read().splitlines()
    loop = next(i for i, line in enumerate(lines, 1) if line.strip().startswith("for update in range("))
    assert loop <= 0.75 * len(lines), (len(lines), loop)


def test_the_code_is_laid_out_by_the_formatter_at_120_columns():
    """`ruff format` (ruff.toml: 120 columns) has nothing to change anywhere; in the scripts and rloo_utils/ no line is
    longer than 120 characters (comments and strings included, which the formatter leaves alone) and no lambda is
    assigned to a name (a def says what it is)."""
    formatted = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
    ruff_check = ["check", "--select", "E501,E731", "--ignore-noqa", "--no-cache"]  # lines over 120, assigned lambdas
    checked = subprocess.run(
        [sys.executable, "-m", "ruff", *ruff_check, *SCRIPTS, "rloo_utils"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_has_a_one_line_help(script):
    """--help reads as a list: each option's docstring is one line (what does not fit is in docs/options.md), those of
    the script's Args and of the groups of options it is made of (rloo_utils' *Options)."""
    import importlib
    import inspect
    import textwrap

    from rloo_utils.options import option_groups

    with open(os.path.join(ROOT, script)) as f:
        classes = [next(n for n in ast.parse(f.read()).body if isinstance(n, ast.ClassDef) and n.name == "Args")]
    groups = option_groups(importlib.import_module(script.removesuffix(".py")).Args)
    assert len(groups) >= 7 and all(group.__name__.endswith("Options") for group in groups)
    classes += [ast.parse(textwrap.dedent(inspect.getsource(group))).body[0] for group in groups]
    num_fields = 0
    for cls in classes:
        body = cls.body[1:] if isinstance(cls.body[0], ast.Expr) else cls.body  # its own docstring: the section's
        fields = [n.target.id for n in body if isinstance(n, ast.AnnAssign) and "ClassVar" not in ast.unparse(n)]
        docs = [n.value.value for n in body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)]
        assert len(docs) == len(fields), f"every option of {cls.name} has its docstring"
        assert [d for d in docs if "\n" in d] == []
        num_fields += len(fields)
    assert num_fields > 90


def test_the_readme_links_to_the_lines_it_names():
    """The README's links into rloo.py, [`name`](rloo.py#L<n>), land on the line that opens what they name: a stage's
    comment, or the def or class of a function or seam (a line number that drifts with an edit fails here)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        links = re.findall(r"\[`([^`]+)`\]\(rloo\.py#L(\d+)\)", f.read())
    with open(os.path.join(ROOT, "rloo.py")) as f:
        lines = f.read().splitlines()
    assert len(links) >= 10  # the six stages, main() and the seams

    def opens(line: str, name: str) -> bool:
        line = line.strip()
        return line.startswith(name) or bool(re.match(rf"(def|class) {re.escape(name.removesuffix('()'))}\b", line))

    for name, number in links:
        where = [i for i, line in enumerate(lines, 1) if opens(line, name)]
        assert where == [int(number)], (
            f"the README links {name} to rloo.py line {number}; the lines that open it: {where}"
        )


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_each_group_of_options_in_its_section_and_every_flag_keeps_its_name(script, capsys, monkeypatch):
    """The groups of options a script's Args is made of (LoRA, tools, evaluation, ...) are each a titled section of
    --help holding their options, and the command line parses to what a flat Args would: the same flags and aliases,
    the same values."""
    import dataclasses
    import importlib
    import sys

    import tyro

    from rloo_utils.options import option_groups, parse_args

    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_:
        parse_args(module.Args)
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    titles = {"LoraOptions": "lora", "ToolUseOptions": "tool use", "OldTrlOptions": "old trl"}
    groups = option_groups(module.Args)
    assert {g.__name__ for g in groups} >= set(titles) | {"EvaluationOptions", "LoggingOptions", "CheckpointOptions"}
    lines = help_text.splitlines()
    headers = [  # a title above a rule (a section's description is above one too)
        i
        for i in range(len(lines) - 1)
        if re.fullmatch(r"[-─]{20,}", lines[i + 1].strip(" │")) and lines[i].strip(" │╭─╮").endswith("options")
    ]
    sections = {  # title -> text, from its header to the next one
        lines[i].strip(" │╭─╮"): "\n".join(lines[i : j - 1]) for i, j in zip(headers, headers[1:] + [len(lines) + 1])
    }

    def section_of(group) -> str:
        default_title = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", group.__name__.removesuffix("Options")).lower()
        return sections[f"{titles.get(group.__name__, default_title)} options"]

    def flags(section: str) -> set[str]:  # the flags it lists: below its description's rule, not indented as help is
        rows = section.splitlines()
        last_rule = max(i for i, row in enumerate(rows) if re.fullmatch(r"[-─]{20,}", row.strip(" │")))
        return {
            name
            for row in rows[last_rule + 1 :]
            if re.match(r"[│ ]{1,3}\S", row)
            for name in re.findall(r"--(\w+)", row)
        }

    for group in groups:
        assert " ".join(group.__doc__.split()[:4]) in " ".join(section_of(group).split())  # its description
        for option in dataclasses.fields(group):  # in the section of the group that declares it, and there only
            declaring = next(c for c in group.__mro__ if option.name in vars(c).get("__annotations__", {}))
            assert declaring in groups and option.name in flags(section_of(declaring))
            assert (option.name in flags(section_of(group))) == (declaring is group), (option.name, group)
    argv = ["--use_peft", "--lora_r", "4", "--eval_steps", "3", "--run_name", "x", "--normalize_advantage", "--track"]
    argv += ["--tools", "a.py:f", "--dtype", "bfloat16", "--rloo_k", "3", "--kl_coef", "0.1", "--save_steps", "2"]
    monkeypatch.setattr(sys, "argv", [script, *argv])
    parsed = parse_args(module.Args)
    assert type(parsed) is module.Args
    assert parsed == tyro.cli(module.Args, args=argv, use_underscores=True)
    assert (parsed.use_peft, parsed.lora_r, parsed.num_generations, parsed.normalize_advantages) == (True, 4, 3, True)


def test_a_fork_s_args_derived_from_a_script_s_parse_with_the_fork_s_defaults_and_options(monkeypatch):
    """A fork may derive its Args from rloo.py's, give a group's option another default and add one of its own: the
    groups are still rloo_utils' (the script's Args counting as the fork's own options), the command line parses to
    the fork's Args, and what a resumed run may change is still the script's."""
    import sys
    from dataclasses import dataclass

    import rloo
    from rloo_utils.options import option_groups, parse_args, resumable_options

    @dataclass
    class Args(rloo.Args):
        eval_steps: float = 3.0
        """a fork's own default"""
        my_option: int = 7
        """a fork's own option"""

    assert option_groups(Args) == option_groups(rloo.Args)
    assert resumable_options(Args) == resumable_options(rloo.Args) and "reward_timeout" in resumable_options(Args)
    monkeypatch.setattr(sys, "argv", ["fork.py", "--my_option", "8"])
    parsed = parse_args(Args)
    assert type(parsed) is Args and (parsed.eval_steps, parsed.my_option) == (3.0, 8)
    monkeypatch.setattr(sys, "argv", ["fork.py", "--eval_steps", "5", "--rloo_k", "3"])
    parsed = parse_args(Args)
    assert (parsed.eval_steps, parsed.num_generations, parsed.my_option) == (5.0, 3, 7)
