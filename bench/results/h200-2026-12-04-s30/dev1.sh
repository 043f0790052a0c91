#!/bin/bash
# session 30, call 1: build; GPU tests of the scan fast path and Ulysses; scan_host before/after alternated
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONPATH=/tmp/site
t0=$(date +%s)
timeout 400 python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 > $OUT/build.txt 2>&1
echo "build rc=$? $(( $(date +%s) - t0 ))s" | tee $OUT/summary.txt
python3 - <<'PY' >> $OUT/summary.txt 2>&1
import importlib.util, os, glob, shutil
d = os.path.dirname(importlib.util.find_spec("allscan._C").origin)
for f in glob.glob(d + "/_C*.so") + glob.glob(d + "/liballscan.so*"):
    shutil.copy(f, "scratch/before/python/allscan/", follow_symlinks=True)
print("core from", d)
PY
for i in 1 2 3; do
  timeout 90 torchrun --nproc-per-node 1 scratch/run_tree.py scratch/before/bench/scan_host.py --calls 2000 --out $OUT/before$i > $OUT/scan_host_before$i.txt 2>&1
  echo "before$i rc=$?" >> $OUT/summary.txt
  timeout 90 torchrun --nproc-per-node 1 bench/scan_host.py --calls 2000 --out $OUT/after$i > $OUT/scan_host_after$i.txt 2>&1
  echo "after$i rc=$?" >> $OUT/summary.txt
done
timeout 300 python3 -m pytest -m gpu -q -rs tests/test_scan_gpu.py tests/test_matrix_scan_gpu.py -k "eager_fast_path or async or graph_capture" -p no:cacheprovider > $OUT/scan_gpu.txt 2>&1
echo "scan_gpu rc=$?" >> $OUT/summary.txt
timeout 240 python3 -m pytest -m gpu -q -rs tests/test_ulysses_gpu.py -p no:cacheprovider > $OUT/ulysses_gpu.txt 2>&1
echo "ulysses_gpu rc=$?" >> $OUT/summary.txt
for f in $OUT/scan_host_*.txt; do echo "== $f"; grep -A9 "added over the core" $f | head -9; grep "core (_C.scan via the plan) \[idle" $f; done
tail -3 $OUT/scan_gpu.txt $OUT/ulysses_gpu.txt
cat $OUT/summary.txt
