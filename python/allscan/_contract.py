"""What every allscan op and layer shares, in three modules (this one names them together):

- :mod:`allscan._dtypes`: :data:`DTYPE_CODES`, torch dtype -> the core's dtype code; the only table.
- :mod:`allscan._settings`: :data:`settings`, every ``ALLSCAN_*`` environment variable, read and
  validated once, at first use (:data:`VARIABLES`; README.md's table mirrors it).
- :mod:`allscan._agreement`: :func:`check_across_ranks`, the one cross-rank signature check every
  collective runs before it communicates, and :func:`announce_invalid` for a rank whose own
  arguments failed a local check.
"""
from __future__ import annotations

from ._agreement import (MAX_CHECKED_SIGNATURES, announce_invalid, check_across_ranks, clear_checked_signatures,
                         peers_exchange, signature_hash, still_checked)
from ._dtypes import DTYPE_CODES, DTYPE_NAMES, dtype_code
from ._settings import NOT_SETTINGS, VARIABLES, Variable, markdown_table, settings

__all__ = [
    "DTYPE_CODES",
    "DTYPE_NAMES",
    "dtype_code",
    "Variable",
    "VARIABLES",
    "NOT_SETTINGS",
    "settings",
    "markdown_table",
    "MAX_CHECKED_SIGNATURES",
    "check_across_ranks",
    "still_checked",
    "signature_hash",
    "announce_invalid",
    "peers_exchange",
    "clear_checked_signatures",
]
