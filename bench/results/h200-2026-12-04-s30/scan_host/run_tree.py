"""Session script (thirtieth run): run a script of an earlier tree (scratch/before, from `git archive`)
against this build's core. The editable install's finder is removed and the tree's python/ goes first
(the script also inserts it); the device call copied the built _C and liballscan there first.

    torchrun --nproc-per-node 1 scratch/run_tree.py scratch/before/bench/scan_host.py --calls 2000
"""
import os
import runpy
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "skbc" not in type(f).__module__]
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(script)), "..", "python"))
runpy.run_path(script, run_name="__main__")
