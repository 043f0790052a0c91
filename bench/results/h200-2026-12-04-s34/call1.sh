#!/usr/bin/env bash
# Call 1 (carries .whl, .tl1): fla's wheels and tilelang part 1; build; where KDA's eager host time goes
# at 8K (KDA's backward needs no tilelang), one GPU standing in for a middle rank.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/tl .tl1/*.whl >> $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export PYTHONPATH=/tmp/site
timeout -k 5 300 torchrun --nproc-per-node 1 bench/delta_bench.py --host-profile --profile --layers kda --tlocal 8192 \
  --repeats 3 --fla-autotune one --out $OUT/host > $L/10_kda_host.txt 2>&1
echo "rc=$?" >> $L/10_kda_host.txt
grep "host split" $L/10_kda_host.txt; tail -5 $L/10_kda_host.txt
