#!/usr/bin/env bash
# Call 2 (the machine warm from call 1; carries .tl2): tilelang part 2; where Gated DeltaNet's eager host
# time goes at 8K and 16K (cProfile, torch.profiler, the split by stage), one GPU standing in for a
# middle rank.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/tl .tl2/*.whl > $L/00_tl2.txt 2>&1
export PYTHONPATH=/tmp/site:/tmp/tl
timeout -k 5 400 torchrun --nproc-per-node 1 bench/delta_bench.py --host-profile --profile --layers gdn \
  --tlocal 8192 16384 --repeats 3 --fla-autotune one --out $OUT/host > $L/20_gdn_host.txt 2>&1
echo "rc=$?" >> $L/20_gdn_host.txt
grep "host split" $L/20_gdn_host.txt; tail -8 $L/20_gdn_host.txt
