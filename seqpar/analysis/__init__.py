"""Analytic memory and FLOPs model of the paper (torch-free), in three rooms, each importing only
those below it.

``formulas``: the paper's terms (activation memory, model states, FLOPs, a pipeline stage, MoE, the
Table 3 presets) and ``shapes``, the one adapter from a configuration to their inputs; ``planning``:
the cost model, the accelerators' data sheets, profiles and calibration, rank placement, the planner
and its uneven split; ``reports``: ``seqpar paper``'s tables and plots, the plan's text, the emitted
job, the published-runs check. ``text`` (plain-text tables) sits beside them, below all three.
"""
