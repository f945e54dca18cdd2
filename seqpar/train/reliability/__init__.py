"""What keeps a job going or stops it cleanly: supervision and restarts, heartbeats, stragglers,
interrupts, faults."""
