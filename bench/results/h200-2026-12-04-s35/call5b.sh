#!/usr/bin/env bash
# Call 5b (the machine warm from call 5; its output is call5/log/51_errors.txt): the three errors of
# _sp_equals_one_process (loss pair, logits, gradients) for the packed and unpacked hybrid KDA model and
# the packed KDA model, fla's model against allscan's sequence-parallel one, printed whole.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 ALLSCAN_FLA_AUTOTUNE=one ALLSCAN_TEST_RANKS_PER_GPU=2 TRITON_F32_DEFAULT=ieee PYTHONPATH=/tmp/site; mkdir -p $OUT/log; cd tests && timeout 300 python3 -c "
from distributed import run_distributed
import test_integration_fla as t
for kind, packed in (('kda_hybrid', True), ('kda_hybrid', False), ('kda', True)):
    r = run_distributed(t._sp_equals_one_process, 2, kind, 'cuda', packed, backend='nccl', timeout=400)
    print(kind, 'packed' if packed else 'one sequence per row', [{k: v for k, v in x.items() if k in ('loss', 'logits', 'grads')} for x in r], flush=True)
" 2>&1 | grep -v Warning | tee $OUT/log/51_errors.txt | tail -5
