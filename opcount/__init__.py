"""Analytic FP/BP operation counting over the aiperf graph IR. Imports no deep-learning framework."""

from aiperf_opcount.counting import EpochCount, NodeCount, OpCount, count
from aiperf_opcount.rules import CATEGORIES, CONVENTIONS

__all__ = ["count", "OpCount", "NodeCount", "EpochCount", "CATEGORIES", "CONVENTIONS"]
