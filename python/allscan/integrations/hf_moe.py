"""A mixture of experts' routers under sequence parallelism: transformers' MoE models add a load-balancing loss
(``aux_loss``, from ``output_router_logits``) that is a mean over the whole sequence; each rank's model would take
it over its shard alone, so both transformers integrations refuse it by name (:data:`ROUTER_LOGITS`).
"""
from __future__ import annotations

__all__ = ["ROUTER_LOGITS", "router_logits_requested"]

ROUTER_LOGITS = ("output_router_logits=True is not supported: a mixture of experts' load-balancing loss (aux_loss) "
                 "is a mean over the whole sequence, which each rank's model would compute on its shard alone; pass "
                 "output_router_logits=False and set the config's to False")


def router_logits_requested(config, passed) -> bool:
    """Whether a call computes the routers' load-balancing loss: ``passed`` (the call's ``output_router_logits``),
    else the config's (or its text config's), as transformers' MoE models decide."""
    if passed is not None:
        return bool(passed)
    try:
        text = config.get_text_config()
    except Exception:  # noqa: BLE001 - not a transformers config: only its own attribute
        text = config
    return any(bool(getattr(c, "output_router_logits", False)) for c in (config, text) if c is not None)
