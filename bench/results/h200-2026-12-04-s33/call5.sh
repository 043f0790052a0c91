#!/usr/bin/env bash
# Call 5 (warm from call 4): the same for Gated DeltaNet at 8K and KDA at 16K, one after the other.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/tl
L=$OUT/log; mkdir -p $L
timeout -k 5 280 torchrun --nproc-per-node 1 bench/delta_bench.py --graph --layers gdn --tlocal 8192 --repeats 3 \
  --fla-autotune full --out $OUT/bench_gdn8k_full > $L/50_bench_gdn8k_full.txt 2>&1
echo "rc=$?" >> $L/50_bench_gdn8k_full.txt
timeout -k 5 290 torchrun --nproc-per-node 1 bench/delta_bench.py --graph --layers kda --tlocal 16384 --repeats 3 \
  --fla-autotune full --out $OUT/bench_kda16k_full > $L/51_bench_kda16k_full.txt 2>&1
echo "rc=$?" >> $L/51_bench_kda16k_full.txt
grep -A3 "^layer" $L/5*.txt
