"""Measurement: runs the model and counts the bytes it keeps (or the FLOPs it runs), next to the
formulas.

Above the model in the import graph (it builds layers, stages and schedules); ``seqpar.analysis``
holds the torch-free formulas it is compared against.
"""
