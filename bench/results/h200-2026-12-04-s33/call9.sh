#!/usr/bin/env bash
# Call 9 (the machine warm from call 8): a mutation check of the halo-after-a-mismatch test: the core's
# mismatch check removed from allscanNeighborExchange on the device's copy only, rebuilt, the test run;
# it must fail (it did: rank 1's halo returned rank 0's values).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 ALLSCAN_TEST_RANKS_PER_GPU=2 PYTHONPATH=/tmp/site
mkdir -p $OUT/log
grep -c "ALLSCAN_CHECK(mismatchStatus(comm->signatures));" csrc/allscan/allscan.cu > $OUT/log/90_mutation.txt
python3 - <<'PY'
p='csrc/allscan/allscan.cu'
s=open(p).read()
a="""    ALLSCAN_CHECK(mismatchStatus(comm->signatures));
    return neighborExchange("""
assert a in s
s=s.replace(a,"""    return neighborExchange(""")
open(p,'w').write(s)
PY
timeout 60 python3 -m pip install -q --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 >> $OUT/log/90_mutation.txt 2>&1
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_faults.py -k "refuses_after_a_mismatch" >> $OUT/log/90_mutation.txt 2>&1
grep -E "passed|failed|assert r1|halo" $OUT/log/90_mutation.txt | tail -5
