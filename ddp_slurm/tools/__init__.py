"""Operator tools: doctor (preflight on an allocation) and report (plots and summary of runs)."""
