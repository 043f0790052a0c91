#!/usr/bin/env bash
# Call 4 (a fresh machine; carries .whl): after the review. Ulysses' all-to-alls carry a hash of its own
# arguments in their in-band signature: ranks switching between two cached signatures that differ only in
# `causal` must get NaN or an error and CommunicatorError on both ranks (with the other switch cases); then
# the same with the hash removed on this machine's copy (must fail); the Ulysses GPU tests; fla's KDA and
# hybrid KDA models with the swap built on the meta device. NCCL ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export PYTHONPATH=/tmp/site
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" >> $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
step 40_switch 300 $P tests/test_faults.py -k "cached_signature_switch" &
step 41_fla_kda_models 400 $P tests/test_integration_fla.py -k "on_gpus and kda" &
wait
step 42_ulysses_gpu 400 $P tests/test_ulysses_gpu.py
# the mutation: the all-to-alls' in-band signature without Ulysses' own arguments
sed -i 's/in_band = fields + \[("call signature", call_signature)\] if call_signature else fields/in_band = fields/' python/allscan/ops/a2a.py
grep -n "in_band = " python/allscan/ops/a2a.py > $L/43_mutation_grep.txt
step 43_mutation 200 $P tests/test_faults.py -k "cached_signature_switch and ulysses"
git checkout python/allscan/ops/a2a.py 2>/dev/null
cat $L/summary.txt
