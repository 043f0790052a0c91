"""What the GPU tests of CUDA-graph capture share: capture a step, replay it, compare it with eager."""
import torch


def assert_replay_equals_eager(step, refill, names, rank, dev):
    """``step()`` (returning a tuple of tensors) is warmed up on a side stream, captured in one CUDA
    graph and replayed; the replay's results must equal an eager call's bitwise, and again after
    ``refill()`` copies new values into the tensors the graph reads (nothing stale is replayed)."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for trial in range(2):
        if trial:
            with torch.no_grad():
                refill()
        graph.replay()
        torch.cuda.synchronize(dev)
        eager = step()
        assert len(captured) == len(eager) == len(names)
        for name, a, b in zip(names, captured, eager):
            assert torch.equal(a, b), f"rank {rank}, trial {trial}: the replay's {name} differs from eager"
