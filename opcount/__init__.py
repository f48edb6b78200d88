"""Analytic FP/BP operation counting over the aiperf graph IR. Imports no deep-learning framework."""

from opcount.counting import EpochCount, NodeCount, OpCount, count
from opcount.rules import CATEGORIES, CONVENTIONS

__all__ = ["count", "OpCount", "NodeCount", "EpochCount", "CATEGORIES", "CONVENTIONS"]
