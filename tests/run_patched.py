"""Run a script as __main__ after a patch module: `python tests/run_patched.py PATCH.py SCRIPT.py [script args...]`.

The patch (a file) is imported first, so that what it replaces (an attention function, an optimizer's step) is in place
before the script imports anything; the script then runs as `python SCRIPT.py args...` would run it (its folder first
on sys.path, sys.argv its own). Works under torchrun too: `python -m torch.distributed.run ... tests/run_patched.py ...`.
"""

import importlib.util
import os
import runpy
import sys

if __name__ == "__main__":
    patch, script, *args = sys.argv[1:]
    spec = importlib.util.spec_from_file_location("run_patched_patch", patch)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT.py`: its folder, not tests/
    runpy.run_path(script, run_name="__main__")
