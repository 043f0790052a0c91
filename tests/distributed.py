"""Run a function on N spawned ranks with torch.distributed initialised (gloo, or NCCL on GPUs).

    run_distributed(fn, world_size, *args, timeout=120, backend="gloo")

calls ``fn(rank, world_size, *args)`` in each of ``world_size`` processes and re-raises, in the
parent, the first failure (with the rank's traceback). A run that does not finish within ``timeout``
seconds is killed and raises ``TimeoutError``: a hang is a test failure, never a stuck CI. ``fn``
must be a module-level function (it is pickled into the children).

How the ranks start: on a machine without CUDA (the CI) they are forked from a forkserver that has imported
torch and transformers once (:data:`PRELOAD`), so a rank starts in a fraction of a second instead of importing
them again (seconds each, most of the suite's time on two cores); each rank then takes the parent's environment
as it is at the call. With CUDA they are spawned: a process that forks must not have touched CUDA, and the GPU
suite's few runs gain little.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback


RANKS_PER_GPU = "ALLSCAN_TEST_RANKS_PER_GPU"


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def ranks_per_gpu() -> int:
    """``ALLSCAN_TEST_RANKS_PER_GPU`` (default 1): how many NCCL ranks of a test may share one GPU."""
    value = os.environ.get(RANKS_PER_GPU, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{RANKS_PER_GPU} must be a positive integer, got {value!r}")
    return int(value)


def nccl_ranks() -> int:
    """How many NCCL ranks a test can start here: the GPUs times ``ranks_per_gpu()``."""
    return _gpu_count() * ranks_per_gpu()


def skip_unless_gpus(n: int) -> None:
    """Skip the calling test unless this machine has ``n`` CUDA GPUs (a test of speed or of NVLink)."""
    import pytest

    if _gpu_count() < n:
        pytest.skip(f"needs {n} CUDA GPU{'s' if n > 1 else ''}")


def skip_unless_nccl_ranks(n: int) -> None:
    """Skip the calling test unless ``n`` NCCL ranks can run here (GPUs times ``ranks_per_gpu()``)."""
    import pytest

    gpus = _gpu_count()
    if nccl_ranks() < n:
        pytest.skip(f"needs {n} CUDA GPUs (or {RANKS_PER_GPU}={-(-n // max(gpus, 1))} with {max(gpus, 1)})"
                    if gpus else "needs CUDA")


def _share_gpus(rank: int) -> None:
    """Make this rank a host of its own to NCCL (before NCCL starts in this process), reached through
    the socket transport on the loopback interface (module docstring)."""
    os.environ["NCCL_HOSTID"] = f"allscan-test-rank-{rank}"
    os.environ["NCCL_IB_DISABLE"] = "1"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the forkserver imports once (a module that is not installed is skipped by multiprocessing).
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.modeling_utils", "fla.layers"]
_FORKSERVER: list = []


def _start_context():
    """The multiprocessing context the ranks start from (module docstring)."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    if not _FORKSERVER:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _FORKSERVER.append(ctx)
    return _FORKSERVER[0]


def _child(call, rank, world_size, backend, init_file, q, teardown=True, env=None):
    try:
        if env is not None:  # forked from the forkserver: the parent's environment now, not at the server's start
            os.environ.clear()
            os.environ.update(env)
        fn, args = pickle.loads(call)  # imports the test's module (and allscan) under that environment
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        kwargs = {}
        if backend == "nccl":
            if world_size > torch.cuda.device_count():
                _share_gpus(rank)
            torch.cuda.set_device(rank % torch.cuda.device_count())
            kwargs["device_id"] = torch.device("cuda", rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, **kwargs)
        try:
            result = fn(rank, world_size, *args)
        except BaseException:  # noqa: BLE001
            # Report first: the other ranks may be blocked in a collective this rank never joins,
            # so no barrier or teardown here (the parent kills what is left).
            q.put((rank, "error", traceback.format_exc()))
            q.close()
            q.join_thread()
            os._exit(1)
        if not teardown:  # a rank may be dead: no collective on the default group, report and leave
            q.put((rank, "ok", result))
            q.close()
            q.join_thread()
            os._exit(0)
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world_size, *args, timeout=120, backend="gloo", may_exit=()):
    """Returns the list of every rank's return value (rank order). A rank in ``may_exit`` may leave
    without reporting (a fault test killing it): its value is None."""
    ctx = _start_context()
    env = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    q = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="allscan_pg_")
    os.close(fd)
    os.unlink(init_file)
    # the function and its arguments as plain pickled bytes: multiprocessing would hand each tensor over as a
    # shared-memory file descriptor, and a forkserver takes at most 256 of them per process
    call = pickle.dumps((fn, args))
    procs = [ctx.Process(target=_child, args=(call, r, world_size, backend, init_file, q, not may_exit, env),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    errors = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                if errors:
                    break  # the others hang on a collective the failed rank left: report its error
                raise TimeoutError(
                    f"run_distributed: {fn.__name__} on {world_size} ranks did not finish in {timeout} s "
                    f"(finished: {sorted(results)}; failed: {[r for r, _ in errors]})")
            try:
                rank, status, payload = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                for i in may_exit:
                    if not procs[i].is_alive() and i not in results and i not in [r for r, _ in errors]:
                        results[i] = None
                if errors and all(not p.is_alive() or i in results or i in [r for r, _ in errors]
                                  for i, p in enumerate(procs)):
                    break
                # A rank that died without reporting (a crash) is a failure too.
                dead = [i for i, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None) and i not in results
                        and i not in [r for r, _ in errors]]
                for i in dead:
                    errors.append((i, f"rank {i} exited with code {procs[i].exitcode} without reporting"))
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append((rank, payload))
                # Give the other ranks a moment to report their own errors, then stop.
                deadline = min(deadline, time.monotonic() + 15)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        errors.sort()
        rank, tb = errors[0]
        others = "".join(f"\n(rank {r} failed too: {t.strip().splitlines()[-1]})" for r, t in errors[1:])
        raise AssertionError(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{tb}{others}")
    return [results[r] for r in range(world_size)]
