#!/usr/bin/env bash
# Do asynchronous rollouts learn as synchronous ones do? rloo_vllm.py against a vLLM server, --max_staleness 0 and 1,
# over many seeds of vllm_sampling_learning.sh's cheap task: the tests' tiny model (built here, ~2M parameters) and
# prompts, reward = how often "good" appears (tests/reward_fixtures.py:count_good), 40 updates of 32 completions. The
# server (started here, as docs/vllm.md starts it) runs on the first core and each run on the second (taskset), one
# run at a time (~15 s a run on 2 cores). Needs vLLM.
#
#   bash benchmark/experiments/async_learning.sh          # extra arguments go to benchmark/launch.py (--dry_run)
#   SEEDS=8 OUT=elsewhere bash benchmark/experiments/async_learning.sh   # default 16 seeds, runs_async_learning/
#
# Then the first and last 5 updates' mean reward of each, over the seeds, are printed (benchmark/plot.py), with the
# difference of the last 5 (N = 1 minus N = 0) and its 95% bootstrap interval over seeds.
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds=${SEEDS:-16}
out=${OUT:-runs_async_learning}
if [ -e "$out" ]; then echo "async_learning.sh: error: $out exists: give another folder" >&2; exit 2; fi
cores=($(python -c "import os; print(*sorted(os.sched_getaffinity(0))[:2])"))
if [ ${#cores[@]} -lt 2 ]; then echo "async_learning.sh: error: the server and the runs need a core each" >&2; exit 2; fi
mkdir -p "$out"
python -c "import sys; sys.path.insert(0, 'tests'); from conftest import build_tiny_task; build_tiny_task('$out')"
port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
url="http://127.0.0.1:$port"

start_server() {  # as docs/vllm.md starts it, on the first core; stopped when this script ends
    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 \
        taskset --cpu-list "${cores[0]}" python -m vllm.entrypoints.openai.api_server --model "$out/tiny/policy" \
        --port "$port" --dtype float32 --enforce-eager --no-enable-chunked-prefill --max-model-len 512 \
        --generation-config vllm --logprobs-mode processed_logprobs > "$out/server.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    until python -c "import urllib.request; urllib.request.urlopen('$url/v1/models', timeout=5)" 2>/dev/null; do
        if ! kill -0 $server 2>/dev/null; then
            echo "async_learning.sh: error: the server did not start; see $out/server.log" >&2
            exit 1
        fi
        sleep 2
    done
}

case " $* " in *" --dry_run "*) dry_run=1 ;; *) dry_run=0 ;; esac
if [ $dry_run = 0 ]; then start_server; fi
task="--model_name_or_path $out/tiny/policy --dataset_name $out/prompts.jsonl \
--reward_funcs tests/reward_fixtures.py:count_good --total_episodes 1280 --per_device_train_batch_size 32 \
--max_completion_length 8 --learning_rate 3e-3 --num_generations 4 --beta 0 --num_sample_generations 0 \
--vllm_mode server --vllm_server_base_url $url"
export WANDB_MODE=${WANDB_MODE:-offline} TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
run="taskset --cpu-list ${cores[1]} python rloo_vllm.py $task"
python benchmark/launch.py --num_seeds "$seeds" --workers 1 --log_dir "$out/logs" \
    --command "$run --max_staleness 0 --exp_name async_n0" --command "$run --max_staleness 1 --exp_name async_n1" "$@"
if [ $dry_run = 1 ]; then exit 0; fi
python benchmark/plot.py --runs runs --regex '^async_(n0|n1)__' --metrics reward --last 5 --output "$out/reward.png"
python - <<'PY'
import glob, json, os
import numpy as np
last = {}
for name in ("async_n0", "async_n1"):
    for folder in glob.glob(f"runs/{name}__*"):
        seed = int(os.path.basename(folder).split("__")[1])  # runs/<exp_name>__<seed>__<time>
        rows = [r for r in map(json.loads, open(os.path.join(folder, "metrics.jsonl"))) if "episode" in r]
        last.setdefault(name, {})[seed] = np.mean([r["reward"] for r in rows[-5:]])
seeds = sorted(set(last["async_n0"]) & set(last["async_n1"]))
difference = np.array([last["async_n1"][s] - last["async_n0"][s] for s in seeds])
boot = np.random.default_rng(0).choice(difference, (10000, len(difference))).mean(1)
print(f"last 5 updates' reward, N = 1 minus N = 0, paired by seed over {len(seeds)} seeds: {difference.mean():.3f} "
      f"(95% bootstrap: {np.percentile(boot, 2.5):.3f} to {np.percentile(boot, 97.5):.3f})")
PY
