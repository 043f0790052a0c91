#!/usr/bin/env bash
# Call B (the machine still warm from call A): tilelang part 2, fla; the layers at P = 2 with ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/tl .tl2/*.whl > $L/00_tl2.txt 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >> $L/00_tl2.txt 2>&1
export PYTHONPATH=/tmp/site:/tmp/tl
python3 -c "import tilelang, fla; print('tilelang', tilelang.__version__, 'fla', fla.__version__)" >> $L/00_tl2.txt 2>&1
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" | tee -a $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
step 30_gla 200 $P tests/test_gla_gpu.py -k "whole_sequence and bfloat16 or graph_replay or compiled_equals_eager and 2"
step 31_delta 250 $P tests/test_delta_gpu.py -k "whole_sequence and bfloat16 or (graph_replay or compiled) and gdn-2"
step 32_gdn_module 100 $P tests/test_gated_deltanet.py tests/test_integration_fla.py
cat $L/summary.txt
