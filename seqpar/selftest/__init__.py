"""`seqpar selftest`: what seqpar claims, checked end to end on this machine's device in minutes.

Checks (``runner.CHECKS``): parity of every recompute mode and of t = N with sequence parallelism
against the single-process model; activation memory of each Table 2 row, by the saved-tensor meter
and (on an accelerator) the device allocator, against the exact formula; Table 4 on this device;
MFU/HFU against a measured GEMM peak and the data sheet's; a 20-step run whose loss falls.
"""
