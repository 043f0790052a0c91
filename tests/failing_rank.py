"""One rank failing in its own work, for the layers' fault tests: a backend step, or a module's own step,
that raises on rank 1."""
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


def outcome_when_a_layer_fails_on_rank_1(layer, x, where: str) -> str:
    """One fwd+bwd of the module ``layer`` on this rank's shard ``x`` where rank 1 fails in the module's
    own work before one of its collectives: ``where`` "attention_mask" (rank 1 passes one, which the
    layer refuses) or the name of a projection submodule (``q_proj``, ``a_proj``: its forward raises on
    rank 1, as out of memory would). Returns what this rank saw, as :func:`outcome_when_rank_1_fails`."""
    rank = dist.get_rank()
    kwargs = {}
    if where == "attention_mask" and rank == 1:
        kwargs["attention_mask"] = x.new_ones(x.shape[:2])
    elif where != "attention_mask" and rank == 1:
        def failing(*args, **kw):
            raise RuntimeError(f"injected failure in {where}")

        getattr(layer, where).forward = failing  # an instance attribute, deleted below
    try:
        y, _, _ = layer(x, **kwargs)
        y.sum().backward()
        return "done"
    except (RuntimeError, NotImplementedError) as e:
        assert rank == 1 and ("injected" in str(e) or "attention_mask" in str(e)), (rank, e)
        return "raised"
    except ValueError as e:
        assert rank != 1 and "rank(s) [1]" in str(e) and "failed before this call" in str(e), (rank, e)
        return "told"
    finally:
        if where != "attention_mask":
            vars(getattr(layer, where)).pop("forward", None)
