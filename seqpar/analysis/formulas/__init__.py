"""The paper's formulas (Sec. 4-6, App. B/C): activation memory, model states, FLOPs, one pipeline
stage's peak."""
