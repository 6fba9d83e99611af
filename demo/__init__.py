"""The README's demo: the system end to end on one machine without GPUs."""
