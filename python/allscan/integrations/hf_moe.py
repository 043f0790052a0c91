"""A mixture of experts' load-balancing loss under sequence parallelism, exact.

transformers' MoE heads (``*ForCausalLM``; the function is Mixtral's ``load_balancing_loss_func``, which nearly every
family copies) return, when ``output_router_logits`` is on, ``aux_loss = E * sum_e f_e * P_e`` over the rows of every
router (layers x tokens): ``f_e`` the fraction of top-k picks that went to expert ``e``, ``P_e`` its mean routing
probability. Both are means over the WHOLE sequence, which each rank's model would take over its shard alone.

The picks carry no gradient: their counts and the row total are summed over the group (one all-reduce of E + 3
numbers, two flags with them). ``P_e`` is linear in the rows, so this rank's share is
``E * sum_e f_e * (its rows' probability sum) / N``: the shares add up to the one-process ``aux_loss`` and each
rank's backward gives its own rows' part of the one-process gradient, with no differentiable collective (the
convention of ``causal_lm_loss``; ``reduce_loss`` gives the whole value).

The head's forward hook (:func:`replace_aux_loss`) swaps the shard's ``aux_loss`` for this share. It first recomputes
the shard's own value from the same picks and compares it with the model's: a family whose loss is another
function, or whose top-k it cannot find, is refused by name on every rank (the check rides in the same all-reduce).
"""
from __future__ import annotations

import inspect
import sys
from typing import Optional

import torch
import torch.distributed as dist

from .common import comm_device, config_and_text

__all__ = ["router_logits_requested", "computes_aux_loss", "replace_aux_loss", "AUX_LOSS_BASE_ALONE"]

AUX_LOSS_BASE_ALONE = ("output_router_logits=True on the head of a base model made sequence-parallel alone: the "
                       "head's load-balancing loss (aux_loss) would be its shard's; make the whole model (the "
                       "*ForCausalLM) sequence-parallel")
_TOO_FAR = 1e-4  # relative: the model's own shard value against this module's (both accumulate in float32 at least)


def router_logits_requested(config, passed) -> bool:
    """Whether a call computes the routers' load-balancing loss: ``passed`` (the call's ``output_router_logits``),
    else the config's (or its text config's), as transformers' MoE models decide."""
    if passed is not None:
        return bool(passed)
    return any(bool(getattr(c, "output_router_logits", False)) for c in config_and_text(config))


def computes_aux_loss(model) -> bool:
    """Whether ``model`` is a head that computes the load-balancing loss: its forward takes ``labels`` and its
    modeling module defines ``load_balancing_loss_func`` (Kimi Linear's and Nemotron-H's record router logits but
    compute no loss). The same on every rank. The model's transformers class is found in its class's bases: FSDP2
    (``fully_shard``) and ``replicate`` give the model a class of their own, defined in torch."""
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and hasattr(module, "load_balancing_loss_func"):
            try:
                return "labels" in inspect.signature(cls.forward).parameters
            except (TypeError, ValueError):
                return False
    return False


def _first_int(objs, names) -> Optional[int]:
    for obj in objs:
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _experts_and_top_k(model):
    """(E, the candidate top-k values) as the families' heads read them: ``self.num_experts`` /
    ``self.num_experts_per_tok``, or the (text) config's ``num_experts`` / ``num_local_experts`` /
    ``num_experts_per_tok``, DBRX's ``ffn_config.moe_num_experts`` / ``moe_top_k``."""
    objs = [model] + config_and_text(model.config)
    objs += [c.ffn_config for c in objs[1:] if getattr(c, "ffn_config", None) is not None]
    E = _first_int(objs, ("num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts"))
    ks = {k for k in (_first_int([o], ("num_experts_per_tok", "moe_top_k")) for o in objs) if k and E and k <= E}
    return E, sorted(ks)


@torch.compiler.disable
def replace_aux_loss(model, output, sp, where: str):
    """Give ``output`` (the head's, after a call whose routers' loss was requested on every rank of ``sp``) this
    rank's share of the whole sequence's ``aux_loss``, in place; returns ``output``. Every rank takes part in one
    all-reduce. Raises ``NotImplementedError`` on every rank where some rank's output is a tuple
    (``return_dict=False``) or the model's loss is not the one mirrored here. No padding: both integrations refuse
    padding masks, and an all-ones mask weighs every row alike (a padded one would fail the value check)."""
    E, ks = _experts_and_top_k(model)
    if E is None or not ks:
        raise NotImplementedError(f"{where}: {type(model).__name__}'s number of experts / top-k is not found "
                                  "(num_experts or num_local_experts, num_experts_per_tok): its load-balancing loss "
                                  "cannot be made exact under sequence parallelism; pass output_router_logits=False")
    aux = getattr(output, "aux_loss", None)
    logits = getattr(output, "router_logits", None)
    tuple_out = isinstance(output, tuple)
    usable = not tuple_out and isinstance(aux, torch.Tensor) and isinstance(logits, tuple) and len(logits) > 0 \
        and all(isinstance(g, torch.Tensor) and g.dim() == 2 and g.shape[-1] == E for g in logits)
    like = logits[0] if usable else (aux if isinstance(aux, torch.Tensor) else None)
    device = like.device if like is not None else torch.device("cpu")
    acc = torch.promote_types(logits[0].dtype, torch.float32) if usable else torch.float32
    counts = torch.zeros(E, dtype=torch.float64, device=device)
    prob_sum = torch.zeros(E, dtype=acc, device=device)
    rows = 0
    # flags (no host sync before the all-reduce): the model's own value not matched, a tuple output
    mismatch = torch.tensor(float(not usable and not tuple_out), dtype=torch.float64, device=device)
    if usable:
        # as transformers: softmax in the logits' dtype, layer by layer; the top-k that gives the model's own value
        picks = {k: torch.zeros(E, dtype=torch.float64, device=device) for k in ks}
        for g in logits:
            w = torch.nn.functional.softmax(g.to(device), dim=-1)
            for k in ks:
                chosen = torch.topk(w, k, dim=-1)[1].reshape(-1)
                picks[k] = picks[k].scatter_add(0, chosen, torch.ones_like(chosen, dtype=torch.float64))
            prob_sum = prob_sum + w.to(acc).sum(dim=0)
            rows = rows + w.shape[0]
        own = aux.detach().to(torch.float64)
        matched = torch.zeros((), dtype=torch.bool, device=device)
        for k in reversed(ks):  # the first candidate whose shard value is the model's
            matches = (E * (picks[k] / rows * (prob_sum.detach().double() / rows)).sum() - own).abs() \
                <= _TOO_FAR * own.abs().clamp_min(1e-12)
            matches = matches | ~torch.isfinite(own)  # a NaN or inf router logit: the share is NaN, as one process's
            counts = torch.where(matches, picks[k], counts)
            matched = matched | matches
        mismatch = (~matched).to(torch.float64)
    stats = torch.cat([counts, counts.new_tensor([rows, float(tuple_out)]), mismatch.reshape(1)])
    if sp.size > 1:
        stats = stats.to(comm_device(sp, stats))
        dist.all_reduce(stats, group=sp.process_group)  # not differentiable: counts, rows and flags only
        stats = stats.to(device)
    tuples, mismatched = stats[E + 1:].tolist()
    if tuples:
        raise NotImplementedError(f"{where}: output_router_logits with return_dict=False is not supported (the tuple "
                                  "does not say where aux_loss is); call the model with return_dict=True")
    if mismatched:
        raise NotImplementedError(
            f"{where}: {type(model).__name__}'s load-balancing loss is not transformers' load_balancing_loss_func "
            "as mirrored here (softmax top-k counts times mean routing probabilities), or its top-k is not the "
            "config's: it cannot be made exact under sequence parallelism; pass output_router_logits=False")
    n = stats[E].to(acc)
    share = E * torch.sum(stats[:E].to(acc) / n * (prob_sum / n))
    output.aux_loss = share  # (in float32 at least, as causal_lm_loss: float64 routers keep float64)
    return output
