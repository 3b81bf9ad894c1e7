"""Checkpoints with orbax: pure planning (`plan`) beside saving and restoring (`orbax`)."""
