#!/usr/bin/env bash
# Call 5 (warm from call 4, tilelang in place): KDA in fp32 against fla on the whole sequence, alone
# (cut at 340 s in call 4 beside the compiled tests). As run (one command line):
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2 PYTHONPATH=/tmp/site:/tmp/tl; mkdir -p $OUT/log; timeout -k 5 400 python3 -m pytest -v -rs -p no:cacheprovider -m gpu tests/test_delta_gpu.py -k "whole_sequence and kda-float32" > $OUT/log/50_kda_fp32.txt 2>&1; echo rc=$?; tail -3 $OUT/log/50_kda_fp32.txt
