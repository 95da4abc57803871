"""Reusable test support: a multi-process launcher for pytest (and, later, fault injection).

Shipped with the package so users can test their own checkpointing code the same way.
"""

from .launcher import RankFailure, RankTimeout, launch

__all__ = ["RankFailure", "RankTimeout", "launch"]
