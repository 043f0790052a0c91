#!/usr/bin/env bash
# Call 7 (a fresh machine; carries .whl): build; a delta module (GatedDeltaNet, KimiDeltaAttention) whose rank 1
# fails in its own work (its q projection, before the halo exchange) on NCCL: its peers get the failure through
# the fault board, not the timeout (the modules' own_work ran on gloo only until now); two NCCL ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export PYTHONPATH=/tmp/site ALLSCAN_TEST_RANKS_PER_GPU=2
timeout -k 5 300 python3 -m pytest -v -rs -p no:cacheprovider -m gpu tests/test_faults.py \
  -k "own_work_on_nccl and (GatedDeltaNet or KimiDeltaAttention or gdn)" > $L/70_module_own_work.txt 2>&1
echo "rc=$?" >> $L/70_module_own_work.txt
grep -E "PASS|FAIL|Error|assert" $L/70_module_own_work.txt | head -30; tail -3 $L/70_module_own_work.txt
