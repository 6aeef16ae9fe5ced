"""Seeded fuzzing of the lane core's cancel, deadline and shutdown races (`python -m fuzz --help`)."""
