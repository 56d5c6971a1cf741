#!/bin/bash
# A Slurm job for one run, filled in by benchmark/launch.py --slurm_template (one file per command and seed).
# Edit the #SBATCH lines for your cluster: the GPUs below are what the TL;DR commands of benchmark/experiments/ use
# (1 for rloo.py and rloo_vllm.py colocate, 8 on one node for `torchrun --nproc_per_node 8 rloo_multigpu.py`).
#SBATCH --job-name={{job_name}}
#SBATCH --nodes=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-gpu=8
#SBATCH --output=slurm-%x-%j.out
##SBATCH --partition=your-partition

cd {{workdir}}
export WANDB_TAGS={{wandb_tags}}
{{command}}
