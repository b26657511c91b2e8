"""The training engine: the loop, precision, checkpoints, distribution, optimisers, schedules, logging."""
