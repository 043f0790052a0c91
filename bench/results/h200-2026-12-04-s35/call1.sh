#!/usr/bin/env bash
# Call 1 (a fresh machine; carries .whl, .tl1): build; fla's hybrid KDA model (KDA, then softmax attention with
# grouped k/v heads) made sequence-parallel against fla's own model on the whole sequence (flash_attn_func
# stood in for by SDPA); Ulysses with packed sequences against SDPA per sequence; NCCL ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/tl .tl1/*.whl >> $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export PYTHONPATH=/tmp/site
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" >> $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
step 10_fla_hybrid_kda 400 $P tests/test_integration_fla.py -k "on_gpus and kda" &
step 11_ulysses_packed 400 $P tests/test_ulysses_gpu.py -k "layer_matches" &
wait
cat $L/summary.txt
