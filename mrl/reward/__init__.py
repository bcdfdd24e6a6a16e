"""Rewards: rule functions (math answers, format checks), a registry keyed by data_source, a concurrent evaluator
that never raises on one item's failure, the per-source error counts that stop a run whose reward function is
broken, and the placement of a trajectory's scalar reward on its last response token.

This package imports no torch except in `placement`, so spawned reward workers start fast.
"""
