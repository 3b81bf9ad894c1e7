"""Debug mode: fingerprints of every SPMD call compared across processes, and `barrier`."""
