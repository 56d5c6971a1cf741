#!/usr/bin/env bash
# Download benchmark/gpu/wheels.txt for the GPU machine's Python (3.12, manylinux x86-64) into benchmark/gpu/wheels/,
# each wheel without its dependencies (the list names every one the machine lacks). Run it where pip reaches PyPI:
#     bash benchmark/gpu/download_wheels.sh
# then carry benchmark/gpu/wheels to the GPU machine (64 MiB at most travel with a command; the total is printed).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$here/wheels"
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
grep -v '^\s*\(#\|$\)' "$here/wheels.txt" | sed 's/\s*#.*//' | while read -r requirement; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --dest "$here/wheels" "$requirement"
done
du -ch "$here"/wheels/*.whl | tail -1 | sed 's/total/in all, in benchmark\/gpu\/wheels/'
