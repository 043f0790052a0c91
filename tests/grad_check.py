"""The gradient check every scan flavour's tests make (imported as `grad_check`): one rank's
gradients of x, the operator (decay or transition) and init through allscan.scan, against autograd
through the float64 sequential reference of every rank's inputs."""
import torch


def _grad(t):  # None where the output does not depend on t (P = 1, exclusive): zeros
    return torch.zeros_like(t) if t.grad is None else t.grad


def check_grads(rank, P, xs, ops, init, ws, reference, scan, *, reverse, inclusive, where, op_name):
    """``reference(xs, ops, init, reverse=, inclusive=, exact=True)`` gives every rank's output;
    ``scan(x, op, init)`` this rank's. ``ws``: every rank's weights of the loss sum(y * w)."""
    dtype = xs[rank].dtype
    rx = [t.to(torch.float64, copy=True).requires_grad_() for t in xs]
    rop = [t.to(torch.float64, copy=True).requires_grad_() for t in ops]
    ri = init.to(torch.float64, copy=True).requires_grad_()
    outs = reference(rx, rop, ri, reverse=reverse, inclusive=inclusive, exact=True)
    sum((o * w.double()).sum() for o, w in zip(outs, ws)).backward()
    x = xs[rank].clone().requires_grad_()
    op = ops[rank].clone().requires_grad_()
    i0 = init.clone().requires_grad_()
    (scan(x, op, i0) * ws[rank]).sum().backward()
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_grad(x), _grad(rx[rank]).to(dtype), **tol, msg=where + " dx")
    torch.testing.assert_close(_grad(op), _grad(rop[rank]).to(op.dtype), **tol, msg=where + " d" + op_name)
    head = P - 1 if reverse else 0
    expect = _grad(ri).to(dtype) if rank == head else torch.zeros_like(init)
    torch.testing.assert_close(_grad(i0), expect, **tol, msg=where + " dinit")


def check_compiled(f, x, op, ref, tol):
    """``f(x, op)`` compiled (aot_eager, one graph) equals ``ref`` within ``tol`` (rtol = atol), and
    its gradients of the leaves ``x`` and ``op`` equal eager ``f``'s."""
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x, op)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    out.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    op2 = op.detach().clone().requires_grad_()
    f(x2, op2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(op.grad, op2.grad)
