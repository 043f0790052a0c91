#!/usr/bin/env bash
# Call 2 (the machine warm from call 1; carries .whl, .tl2): tilelang part 2; the delta-rule layers at
# P = 2 against fla on the whole sequence, captured and compiled, and fla's Gated DeltaNet model, side
# by side, NCCL ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/tl .tl2/*.whl > $L/00_tl2.txt 2>&1
export PYTHONPATH=/tmp/site:/tmp/tl
python3 -c "import tilelang, fla; print('tilelang', tilelang.__version__, 'fla', fla.__version__)" >> $L/00_tl2.txt 2>&1
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout -k 5 $lim "$@" > $L/$name.txt 2>&1; local rc=$?; echo "$name rc=$rc $(( $(date +%s)-t0 ))s: $(tail -1 $L/$name.txt)" >> $L/summary.txt; }
P="python3 -m pytest -v -rs -p no:cacheprovider -m gpu"
step 20_kda_bf16 540 $P tests/test_delta_gpu.py -k "whole_sequence and kda-bfloat16" &
step 21_fp32 540 $P tests/test_delta_gpu.py -k "whole_sequence and float32" &
step 22_captured 540 $P tests/test_delta_gpu.py -k "(graph_replay or compiled) and 2" &
step 23_fla_gdn_model 540 $P tests/test_integration_fla.py -k "on_gpus and gdn" &
wait
cat $L/summary.txt
