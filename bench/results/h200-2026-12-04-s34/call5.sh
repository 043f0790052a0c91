#!/usr/bin/env bash
# Call 5 (a fresh machine; carries .whl): build; a probe of the delta layers' state gradient on cuBLAS
# (probes/state_grad_bmm.py); examples/train_sp.py --model kda over two NCCL ranks sharing the GPU (each its
# own NCCL host, as tests/distributed.py does), against one process.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
L=$OUT/log; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $L/00_wheels.txt 2>&1
( time python3 -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ) > $L/01_build.txt 2>&1 || { tail -30 $L/01_build.txt; exit 1; }
export PYTHONPATH=/tmp/site
timeout -k 5 200 python3 bench/results/h200-2026-12-04-s34/probes/state_grad_bmm.py 8192 16384 > $L/50_state_grad_bmm.txt 2>&1
echo "rc=$?" >> $L/50_state_grad_bmm.txt
timeout -k 5 300 torchrun --nproc-per-node 2 --no-python bash -c 'export NCCL_HOSTID=allscan-host-$RANK NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo LOCAL_RANK=0; exec python3 examples/train_sp.py --model kda --compare --steps 20 --seq 512' > $L/51_train_kda.txt 2>&1
echo "rc=$?" >> $L/51_train_kda.txt
cat $L/50_state_grad_bmm.txt; tail -6 $L/51_train_kda.txt
