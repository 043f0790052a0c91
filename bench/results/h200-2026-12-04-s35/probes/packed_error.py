"""Is the packed hybrid's fp32 difference to fla numerical? fla's model (fp32, IEEE dots) on the whole row
and allscan's sequence-parallel model (fp32, 2 NCCL ranks), each against the same model in fp64 (allscan's
layers, one process, torch arithmetic: the exact answer), per rank's slice: max |logits - exact| / max |exact|.

    python3 probes/packed_error.py     (from tests/, ALLSCAN_TEST_RANKS_PER_GPU=2)
"""
import torch

from distributed import run_distributed
import test_integration_fla as t


def _errors(rank, world, kind, packed):
    from allscan.integrations import fla as sp
    from allscan.ops import LOCAL
    from allscan.ops.gla import limit_fla_autotune

    dev = f"cuda:{torch.cuda.current_device()}"
    limit_fla_autotune("one")
    gen = torch.Generator().manual_seed(1)
    T = 128
    ids = torch.randint(0, t.VOCAB, (1, T), generator=gen).to(dev)
    kw = {"cu_seqlens": torch.tensor([0, 40, 100, T], dtype=torch.int32, device=dev)} if packed else {}
    exact_model = sp.sequence_parallel(t.tiny_model(kind, "cpu"), LOCAL).double().to(dev)  # unfused torch paths
    with torch.no_grad():
        exact = exact_model(input_ids=ids, **kw).logits
        fla_logits = t.tiny_model(kind, dev)(input_ids=ids, **kw).logits
        model = sp.sequence_parallel(t.tiny_model(kind, dev))
        Tl = T // world
        sl = slice(rank * Tl, (rank + 1) * Tl)
        sp_logits = model(input_ids=ids[:, sl], **kw).logits
    scale = exact.abs().max()
    return dict(fla=((fla_logits[:, sl].double() - exact[:, sl]).abs().max() / scale).item(),
                allscan=((sp_logits.double() - exact[:, sl]).abs().max() / scale).item())


if __name__ == "__main__":
    for kind in ("kda", "kda_hybrid"):
        for packed in (True, False):
            r = run_distributed(_errors, 2, kind, packed, backend="nccl", timeout=400)
            print(kind, "packed" if packed else "one sequence", "error vs fp64, per rank:",
                  [{k: f"{v:.2e}" for k, v in x.items()} for x in r], flush=True)
