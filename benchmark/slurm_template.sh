#!/bin/bash
# A Slurm job for one run, filled in by benchmark/launch.py --slurm_template (one file per command and seed).
# {{gpus}} is the command's torchrun --nproc_per_node (1 for rloo.py and rloo_vllm.py); edit the rest for your cluster.
#SBATCH --job-name={{job_name}}
#SBATCH --nodes=1
#SBATCH --gpus-per-node={{gpus}}
#SBATCH --cpus-per-gpu=8
#SBATCH --output=slurm-%x-%j.out
##SBATCH --partition=your-partition

cd {{workdir}}
export WANDB_TAGS={{wandb_tags}}
{{command}}
