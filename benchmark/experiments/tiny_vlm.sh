#!/usr/bin/env bash
# (e) Images: a tiny LLaVA (a CLIP vision tower, a Llama language model, ~100k parameters, random weights, saved in
# bf16) learns to name the colour of a solid red, green or blue image, the only thing that tells which colour word
# earns 1 (the reward function colour_named reads the image's pixels; the colours are balanced, so a policy blind
# to the image earns 1/3 at best). The model, 48 images and the reward function are built by tests/conftest.py's
# build_tiny_vlm into tiny_vlm/ (no download). 3 seeds with rloo.py, about 15 s each on 2 CPU cores.
#
#   bash benchmark/experiments/tiny_vlm.sh        # extra arguments go to benchmark/launch.py
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d tiny_vlm ] || python -c "import sys; sys.path.insert(0, 'tests'); from conftest import build_tiny_vlm; build_tiny_vlm('tiny_vlm')"
python benchmark/launch.py --num_seeds 3 --workers 1 \
    --command "python rloo.py --model_name_or_path tiny_vlm/llava --dataset_name tiny_vlm/data/train.jsonl \
--reward_funcs tiny_vlm/colour_reward.py:colour_named --total_episodes 2560 --num_generations 4 \
--per_device_train_batch_size 32 --gradient_accumulation_steps 1 --max_completion_length 3 --learning_rate 3e-3 \
--beta 0 --num_sample_generations 0 --exp_name rloo_tiny_vlm" "$@"

cat <<PLOT
Reward curve from the local runs:
python benchmark/plot.py --runs runs --regex '^(rloo_tiny_vlm)__' --metrics rewards/colour_named/mean \\
    --output benchmark/results/tiny_vlm_colours.png
PLOT
