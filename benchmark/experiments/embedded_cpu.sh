#!/usr/bin/env bash
# (a) The embedded task on a CPU: SmolLM2-135M-Instruct continues movie-review openings, VADER sentiment reward (the
# defaults of both scripts), over 3 seeds with rloo.py and rloo_vllm.py (colocated vLLM engine). One run at a time:
# each uses every core (13-16 min a run on 2 cores). Without a W&B account, set WANDB_MODE=offline.
#
#   bash benchmark/experiments/embedded_cpu.sh             # extra arguments go to benchmark/launch.py (--pr 12, --dry_run)
#
# --dataset_name is given as a path relative to the repository, so that every machine's runs carry the same value
# (openrlbenchmark groups runs by it).
set -euo pipefail
cd "$(dirname "$0")/../.."
python benchmark/launch.py --num_seeds 3 --workers 1 \
    --command "python rloo.py --dataset_name data/movie_reviews --track" \
    --command "python rloo_vllm.py --dataset_name data/movie_reviews --track" "$@"

tag=$(git describe --tags --always --dirty)
cat <<PLOT
Learning curves from the local runs (runs/*/metrics.jsonl):
python benchmark/plot.py --runs runs --regex '^(rloo|rloo_vllm)__' \\
    --metrics reward kl completions/mean_length --output benchmark/results/embedded_cpu.png

From W&B (openrlbenchmark 0.3.1 in an environment of its own, benchmark/requirements-openrlbenchmark.txt; replace ?we=... with your entity, and the tag with --pr's pr-N if given):
.venv-openrlbenchmark/bin/python -m openrlbenchmark.rlops_multi_metrics \\
    --filters '?we=${WANDB_ENTITY:-your-entity}&wpn=rloo&xaxis=train/episode&ceik=dataset_name&cen=exp_name&metrics=train/reward&metrics=train/kl&metrics=train/completions/mean_length&metrics=train/objective/rlhf_reward' \\
        "rloo?tag=$tag" "rloo_vllm?tag=$tag" \\
    --env-ids data/movie_reviews \\
    --pc.ncols 4 \\
    --pc.ncols-legend 1 \\
    --pc.xlabel "Episode" \\
    --output-filename benchmark/results/embedded_cpu_openrlbenchmark \\
    --scan-history
PLOT
