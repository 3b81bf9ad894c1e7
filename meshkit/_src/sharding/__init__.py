"""Specs, spec trees, meshes, and layouts: which blocks of a global array each process owns.

Pure and cached where possible: `layout` is round-trip tested against JAX's own index maps.
"""
