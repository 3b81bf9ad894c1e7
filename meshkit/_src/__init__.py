"""meshkit's implementation, one package per concept; the public faces re-export from here.

Layers, lowest first (a package imports only from lower layers; `tests/test_architecture.py`
enforces it): core < lifecycle < {coord, launch, migrate} < debug < runtime < sharding <
{arrays, checkpoint, loaders} < spmd < pmap < the faces (`meshkit`, `meshkit.debug`, ...).
"""
