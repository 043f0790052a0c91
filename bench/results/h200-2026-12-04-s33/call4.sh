#!/usr/bin/env bash
# Call 4 (the machine warm from call 3: built, tilelang installed): Gated DeltaNet at 16K as the middle
# rank on one GPU, captured and eager, against fla with fla's own autotuning (the floor as fla's users
# run it), alone on the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/tl
L=$OUT/log; mkdir -p $L
timeout -k 5 560 torchrun --nproc-per-node 1 bench/delta_bench.py --graph --layers gdn --tlocal 16384 --repeats 3 \
  --fla-autotune full --out $OUT/bench_gdn16k_full > $L/40_bench_gdn16k_full.txt 2>&1
echo "rc=$?" >> $L/40_bench_gdn16k_full.txt
tail -25 $L/40_bench_gdn16k_full.txt
