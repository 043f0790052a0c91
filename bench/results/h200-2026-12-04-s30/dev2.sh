#!/bin/bash
# session 30, call 2: the final tree's one-GPU tests (all but the fla-heavy GLA/delta/widen files), then GLA as another rank
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 > $OUT/build.txt 2>&1
echo "build rc=$?" > $OUT/summary.txt
timeout 330 python3 -m pytest -m gpu -q -rs tests --ignore=tests/test_gla_gpu.py --ignore=tests/test_delta_gpu.py --ignore=tests/test_widen.py -p no:cacheprovider --timeout 300 > $OUT/gpu_suite.txt 2>&1
echo "gpu_suite rc=$?" >> $OUT/summary.txt
timeout 170 python3 -m pytest -m gpu -v -rs tests/test_gla_gpu.py -k "one_gpu_as_another and bfloat16 and not simple" -p no:cacheprovider > $OUT/gla_gpu.txt 2>&1
echo "gla_gpu rc=$?" >> $OUT/summary.txt
tail -4 $OUT/gpu_suite.txt; grep -E "FAILED|^E " $OUT/gpu_suite.txt | head -20; grep -E "PASSED|FAILED|passed|failed" $OUT/gla_gpu.txt | tail -5
cat $OUT/summary.txt
