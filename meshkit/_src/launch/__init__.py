"""``meshkit launch``: start the ranks, supervise them, stop them, report. Imports no JAX."""
