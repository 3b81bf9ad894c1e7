"""``spmd``: per-device code over a mesh, with input placement, collectives, variance analysis."""
