#!/usr/bin/env bash
# Call 8 (the machine warm from call 7, built): the mutation check of call 7's module case: with own_work no longer
# telling the peers (the device's copy of ops/_launch.py edited, not the repository's), the KDA module case must fail.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
L=$OUT/log; mkdir -p $L
sed -i 's/        tell_peers_of_failure(group, op, step, e)$/        pass  # mutation: the peers are not told/' python/allscan/ops/_launch.py
grep -n "mutation" python/allscan/ops/_launch.py > $L/80_mutation.txt
export PYTHONPATH=/tmp/site ALLSCAN_TEST_RANKS_PER_GPU=2
timeout -k 5 240 python3 -m pytest -v -rs -p no:cacheprovider -m gpu tests/test_faults.py \
  -k "own_work_on_nccl and KimiDeltaAttention" >> $L/80_mutation.txt 2>&1
echo "rc=$?" >> $L/80_mutation.txt
grep -E "PASS|FAIL|mutation|Timeout|timed out|elapsed" $L/80_mutation.txt | head -20; tail -3 $L/80_mutation.txt
