#!/usr/bin/env bash
# Call 2 (the machine warm from call 1; carries .tl2): tilelang part 2; fla's hybrid Gated DeltaNet model
# (Gated DeltaNet, then softmax attention) against fla's own model on the whole sequence, and the plain one.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/tl .tl2/*.whl > $L/00_tl2.txt 2>&1
export PYTHONPATH=/tmp/site:/tmp/tl
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" >> $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
step 20_fla_hybrid_gdn 400 $P tests/test_integration_fla.py -k "on_gpus and gdn"
cat $L/summary.txt
