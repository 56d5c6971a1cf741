"""The scripts repeat the algorithm on purpose, so that each stands alone; this keeps what they share identical.

Every top-level function, class and constant defined in more than one script must have the same source in each, except
the intended differences named below, each with its reason. A fix in one script is then a fix in all of them.
"""

import ast
import difflib
import os

import pytest

from conftest import ROOT, SCRIPTS

INTENDED_DIFFERENCES = {
    "Args": "rloo_vllm.py adds the --vllm_* options; rloo_multigpu.py --fsdp_cpu_offload, --ddp_timeout and the server's",
    "RESUMABLE_CHANGES": "rloo_vllm.py: the server's address and the engine's memory can change on resume; "
                         "rloo_multigpu.py: the collective timeout",
    "optimizer_step": "rloo_multigpu.py: the gradient norm of the FSDP shards is a DTensor",
    "weights_for_vllm": "rloo_multigpu.py: the shards gathered one tensor at a time",
    "main": "the driver: rloo_vllm.py generates with vLLM and syncs its weights; rloo_multigpu.py forms the process group, "
            "shards the models and gathers the batch",
}


def top_level_definitions(script: str) -> dict[str, str]:
    """name -> source of each top-level def, class and NAME = ... assignment."""
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    definitions = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            definitions[node.name] = ast.get_source_segment(source, node)
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            for target in node.targets:
                definitions[target.id] = ast.get_source_segment(source, node)
    return definitions


DEFINITIONS = {script: top_level_definitions(script) for script in SCRIPTS}
SHARED = sorted({name for a in SCRIPTS for b in SCRIPTS if a < b for name in DEFINITIONS[a].keys() & DEFINITIONS[b].keys()})


def test_the_scripts_share_the_algorithm():
    assert len(SCRIPTS) >= 2 and len(SHARED) > 40  # this guard would pass vacuously on scripts that share nothing
    for name in ["rloo_advantages", "policy_loss", "completion_logprobs", "per_token_kl", "reward_metrics", "main"]:
        assert name in SHARED


@pytest.mark.parametrize("name", [n for n in SHARED if n not in INTENDED_DIFFERENCES])
def test_a_shared_definition_is_identical_in_every_script(name):
    sources = {script: DEFINITIONS[script][name] for script in SCRIPTS if name in DEFINITIONS[script]}
    first_script, first = next(iter(sources.items()))
    for script, source in sources.items():
        assert source == first, (f"{name} differs between {first_script} and {script}: make the fix in every script, or "
                                 "name the difference in INTENDED_DIFFERENCES with its reason")


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


def test_the_plumbing_lives_once_and_knows_no_script():
    """rloo_utils.py defines what no script repeats, and imports none of them: a script passes in what differs."""
    with open(os.path.join(ROOT, "rloo_utils.py")) as f:
        tree = ast.parse(f.read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name and name.startswith("rloo")}
    plumbing = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    for script in SCRIPTS:
        assert not plumbing & DEFINITIONS[script].keys(), f"{script} defines again what rloo_utils.py holds"


# The redesign's targets (issue 24): each script within its size, its training loop in the first three quarters of the
# file, and its differences from rloo.py few: generation and weight sync; the process group, sharding and reductions
# (issue 25 added to rloo_multigpu.py's: the synced generate's image inputs, each process's own rows of the images;
# issue 26: the models built empty, each process reading its own shards, the reference read again, not copied).
# Issue 27 added the LoRA options to each Args (17 lines of --help) and the adapter's few lines to main, its plumbing
# going to rloo_utils.py. Issue 29 added padding-free forwards: the option, the layout at set-up and the packed branch of
# completion_logprobs and reward_model_scores (19 lines), the packing itself going to rloo_utils.py. Issue 37 added the
# GPU precision set-up: --bf16's device default and --tf32 (5 lines of --help), the frozen layers held in bf16, the
# optimizer step's weight check, the engine check under autocast, forward-only FSDP units resharded (multigpu), pushes
# in the engine's dtype; its plumbing in rloo_utils.py (issue 40 splits that module and flattens these again). Its
# items 5 and 9 added the log-probs made from the output layer's inputs a chunk at a time (every script) and, where vLLM
# samples, the trainer's log-probs on vLLM's distribution for the off-policy correction (8 to 15 lines each).
# Issue 38 added --reward_timeout and the check of the rewards' range (5 lines each; on several processes the check
# is agreed between them: 1 more).
SIZE = {"rloo.py": 1060, "rloo_vllm.py": 1230, "rloo_multigpu.py": 1370}
DIFFERENCE = {"rloo_vllm.py": 255, "rloo_multigpu.py": 512}  # issue 37: reshard, engine-dtype pushes, vLLM's tokens


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_stays_the_algorithm_to_read(script):
    """A design check, not a timed test: the plumbing goes to rloo_utils.py, not back into the scripts."""
    with open(os.path.join(ROOT, script)) as f:
        lines = f.read().splitlines()
    loop = next(i for i, line in enumerate(lines, 1) if line.strip().startswith("for update in range("))
    assert len(lines) <= SIZE[script] and loop <= 0.75 * len(lines), (len(lines), loop)
    if script in DIFFERENCE:
        with open(os.path.join(ROOT, "rloo.py")) as f:
            base = f.read().splitlines()
        changed = [line for line in difflib.unified_diff(base, lines, n=0, lineterm="")
                   if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        assert len(changed) <= DIFFERENCE[script], len(changed)
