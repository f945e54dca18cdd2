"""Analytic memory and FLOPs model of the paper (torch-free)."""
