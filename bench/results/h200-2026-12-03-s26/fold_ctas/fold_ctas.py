"""Run a script with fold_state_grad launched on about FOLD_CTAS programs (scratch experiment):
python3 scratch/fold_ctas.py SCRIPT ARGS..."""
import os
import runpy
import sys

import triton

import allscan.ops.delta.fold_in as f

target = int(os.environ["FOLD_CTAS"])


def launch(B, T, H, K, V, cuda_index):
    BK, BV = f._pow2(K), min(f._pow2(V), 64)
    nv = triton.cdiv(V, BV)
    blocks = triton.cdiv(T, f._BLOCK_T)
    splits = max(1, min(blocks, triton.cdiv(target, B * H * nv)))
    t_split = triton.cdiv(blocks, splits) * f._BLOCK_T
    return BK, BV, nv, triton.cdiv(T, t_split), t_split


f._state_grad_launch = launch
print("fold_ctas:", target, launch(1, 16384, 16, 128, 128, 0), flush=True)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
