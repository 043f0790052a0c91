#!/usr/bin/env bash
# Call 1 (carries .whl, .tl1): build; the halo exchange on the core's watched neighbour exchange
# (values, gradients, capture at P = 2, 3; the module against one process; a dead peer; a refused
# exchange after a mismatch), the dead-rank all-to-all case, and KDA's compiled head, NCCL ranks
# sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/tl .tl1/*.whl >> $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export PYTHONPATH=/tmp/site
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" >> $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
ALLSCAN_TEST_RANKS_PER_GPU=2 step 10_faults 200 $P tests/test_faults.py -k "dead_rank_on_nccl and (halo or a2a) or signature_switch and exclusive"
ALLSCAN_TEST_RANKS_PER_GPU=4 step 11_halo_module 300 $P tests/test_gated_deltanet.py &
ALLSCAN_TEST_RANKS_PER_GPU=2 step 12_kda_compiled 400 $P tests/test_delta_gpu.py -k "compiled and kda" &
wait
cat $L/summary.txt
