"""One rank failing in its own work, for the layers' fault tests: a backend step that raises on rank 1."""
import torch.distributed as dist


def outcome_when_rank_1_fails(owner, name: str, call) -> str:
    """Run ``call()`` with ``owner.name`` (a static method, or a module's function) raising on rank 1,
    then restore it: what
    this rank saw: "raised" (rank 1, its own error), "told" (a peer, told that rank 1 failed before
    the collective it waited in), "done" (the call finished)."""
    rank = dist.get_rank()
    real, original = getattr(owner, name), vars(owner)[name]  # the latter as stored: a staticmethod in a class

    def failing(*args, **kwargs):
        if rank == 1:
            raise RuntimeError(f"injected failure in {name}")
        return real(*args, **kwargs)

    setattr(owner, name, staticmethod(failing) if isinstance(owner, type) else failing)
    try:
        call()
        return "done"
    except RuntimeError as e:
        assert rank == 1 and "injected" in str(e), (rank, e)
        return "raised"
    except ValueError as e:
        assert rank != 1 and "rank(s) [1]" in str(e) and "failed before this call" in str(e), (rank, e)
        return "told"
    finally:
        setattr(owner, name, original)
