#!/usr/bin/env bash
# (c) The estimators and losses of rloo.py side by side (benchmark/compare_algorithms.py on benchmark/launch.py's
# worker pool): the test model learning to say "good", 8 configurations x 5 seeds, 2 runs at a time (~5 min on 2
# cores). Add `-- --track` to log the runs to W&B (project rloo-compare-tiny); --preset smollm2 for SmolLM2 and VADER.
#
#   bash benchmark/experiments/algorithms.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
python benchmark/compare_algorithms.py --preset tiny --seeds 1 2 3 4 5 --workers 2 "$@"

tag=$(git describe --tags --always --dirty)
cat <<PLOT
Learning curves from the local runs:
python benchmark/plot.py --runs runs/compare_tiny/runs --metrics reward clip_ratio/region_mean loss/policy_avg \\
    --output benchmark/results/algorithms_tiny.png

From W&B, after a run with -- --track (openrlbenchmark 0.3.1 in an environment of its own, benchmark/requirements-openrlbenchmark.txt; replace ?we=... with your entity):
.venv-openrlbenchmark/bin/python -m openrlbenchmark.rlops_multi_metrics \\
    --filters '?we=${WANDB_ENTITY:-your-entity}&wpn=rloo-compare-tiny&xaxis=train/episode&ceik=wandb_project_name&cen=exp_name&metrics=train/reward&metrics=train/clip_ratio/region_mean&metrics=train/loss/policy_avg' \\
        "rloo?tag=$tag" "grpo?tag=$tag" "dr_grpo?tag=$tag" "reinforce_pp?tag=$tag" "token_ppo_clip?tag=$tag" \\
        "cispo?tag=$tag" "gspo?tag=$tag" "sapo?tag=$tag" \\
    --env-ids rloo-compare-tiny \\
    --pc.ncols 3 \\
    --pc.ncols-legend 1 \\
    --pc.xlabel "Episode" \\
    --output-filename benchmark/results/algorithms_tiny_openrlbenchmark \\
    --scan-history
PLOT
