#!/usr/bin/env bash
# Does rloo_vllm.py learn as rloo.py does? A cheap task over many seeds: the tests' tiny model (built here, ~2M
# parameters) and prompts, reward = how often "good" appears (tests/reward_fixtures.py:count_good), 40 updates of 32
# completions, one run at a time (~10 s a run with rloo.py, ~20 s with rloo_vllm.py on 2 cores). Needs vLLM.
#
#   bash benchmark/experiments/vllm_sampling_learning.sh       # extra arguments go to benchmark/launch.py (--dry_run)
#   SEEDS=8 OUT=elsewhere bash benchmark/experiments/vllm_sampling_learning.sh   # default 24 seeds, runs_vllm_sampling/
#
# Then the first and last 5 updates' mean reward of each script, over the seeds, are printed (benchmark/plot.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds=${SEEDS:-24}
out=${OUT:-runs_vllm_sampling}
if [ -e "$out" ]; then echo "vllm_sampling_learning.sh: error: $out exists: give another folder" >&2; exit 2; fi
mkdir -p "$out"
python -c "import sys; sys.path.insert(0, 'tests'); from conftest import build_tiny_task; build_tiny_task('$out')"
task="--model_name_or_path $out/tiny/policy --dataset_name $out/prompts.jsonl \
--reward_funcs tests/reward_fixtures.py:count_good --total_episodes 1280 --per_device_train_batch_size 32 \
--max_completion_length 8 --learning_rate 3e-3 --num_generations 4 --beta 0 --num_sample_generations 0"
export WANDB_MODE=${WANDB_MODE:-offline} TOKENIZERS_PARALLELISM=false
python benchmark/launch.py --num_seeds "$seeds" --workers 1 --log_dir "$out/logs" \
    --command "python rloo.py $task --exp_name sampling_rloo" --command "python rloo_vllm.py $task --exp_name sampling_rloo_vllm" "$@"
case " $* " in *" --dry_run "*) exit 0 ;; esac
python benchmark/plot.py --runs runs --regex '^sampling_(rloo|rloo_vllm)__' --metrics reward --last 5 \
    --output "$out/reward.png"
