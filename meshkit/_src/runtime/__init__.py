"""Joining the cluster (`meshkit.init`), and the dispatch point every SPMD entry passes."""
