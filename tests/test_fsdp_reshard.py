"""rloo_multigpu.reshard: a frozen model that only runs no_grad forwards goes back to its shards after them.

FSDP2 clears the root unit's post-forward mesh at its lazy init (the root is resharded by the backward instead), so a
root that never runs a backward, as the reference policy and the reward model, would keep its weights gathered on
every process for the whole run: the embeddings, norm and tied LM head of the reference; the backbone and score head of
the reward model, which reward_model_scores calls one by one, so that each is a root of its own (FSDP2's reshard() on
the outer module alone, not recursive, leaves both gathered). On 2 CPU processes (gloo) with the tiny models:
gathered weights after the forward (the defect, without the fix), every weight a DTensor shard after
rloo_multigpu.reshard, and the next forward gathering them again to the same outputs, those of the model unsharded.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_env

pytestmark = pytest.mark.slow  # every test of this file starts a run (tests/conftest.py)

CHECK = os.path.join(ROOT, "tests", "fsdp_reshard_check.py")


@pytest.fixture(scope="module")
def reports(tiny, tmp_path_factory):
    """[report of rank 0, of rank 1], each {"reference": {...}, "reward_model": {...}} (fsdp_reshard_check.py)."""
    out = tmp_path_factory.mktemp("reshard") / "reports.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        CHECK,
        str(out),
        tiny["policy"],
        tiny["reward"],
    ]
    proc = subprocess.run(command, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("case", ["reference", "reward_model"])
def test_a_forward_only_model_keeps_gathered_weights_until_reshard_puts_them_back_in_shards(reports, case):
    assert len(reports) == 2
    for rank, report in enumerate(reports):
        r = report[case]
        assert r["units"] >= 3 and r["before_forward"] == [], (rank, r)  # sharded by shard(): every weight a DTensor
        # The defect: after the no_grad forward the root's weights are gathered, plain tensors (the decoder layers,
        # units that are not roots, are resharded after their own forward)
        assert r["after_forward"], (rank, r)
        assert not any(".layers." in name for name in r["after_forward"]), (rank, r["after_forward"])
        # The fix: every unit back in shards; and again after the next forward, which gathered them anew
        assert r["after_reshard"] == [] and r["after_second_reshard"] == [], (rank, r)
        assert r["after_second_forward"] == r["after_forward"], (rank, r)
        # Resharded, the model computes what it computed, that of the model loaded whole
        assert r["outputs_equal"] and r["outputs_finite"], (rank, r)
        assert r["max_difference_from_unsharded"] < 1e-5, (rank, r)


def test_the_reference_root_holds_the_embeddings_and_norm(reports):
    for report in reports:
        gathered = report["reference"]["after_forward"]
        assert "model.embed_tokens.weight" in gathered and "model.norm.weight" in gathered, gathered
        # FSDP2's reshard() of the root is enough where it is the only root (after the second forward)
        assert report["reference"]["after_outer_reshard_only"] == [], report["reference"]


def test_the_reward_models_backbone_and_score_are_roots_the_outer_reshard_misses(reports):
    for report in reports:
        r = report["reward_model"]
        assert "score.weight" in r["after_forward"] and "model.embed_tokens.weight" in r["after_forward"], r
        # reshard() of the outer module (never run, so never a root) leaves them gathered: rloo_multigpu.reshard
        # visits every unit
        assert r["after_outer_reshard_only"] == r["after_second_forward"] == r["after_forward"], r
