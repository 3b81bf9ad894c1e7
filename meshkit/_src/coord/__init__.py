"""Where processes agree: through JAX's coordination service, never a device collective.

Agreement on each call's description (counted, windowed, checked), named channels for calls made
from several threads, and the timeouts that name the processes that did not come.
"""
