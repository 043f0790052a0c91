#!/usr/bin/env bash
# Call 5 (a fresh machine; carries .whl): fla's hybrid KDA model with packed sequences (cu_seqlens, a bound
# inside each rank's shard) made sequence-parallel, against fla's own model on the whole packed row
# (flash-attn's varlen function stood in for by SDPA per sequence); NCCL ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export PYTHONPATH=/tmp/site
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" >> $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
step 50_fla_hybrid_kda_packed 400 $P tests/test_integration_fla.py -k "packed and on_gpus and kda"
cat $L/summary.txt
