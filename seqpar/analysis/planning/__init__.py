"""The planner and its cost model: accelerators' data sheets, profiles and calibration, rank
placement."""
