"""The ground floor: errors, the one place that touches JAX internals, settings, frames, events.

Also the launcher <-> rank contract (`contract`: environment variables and words both sides
use, `events`: the records ranks write for the launcher). Imports nothing else of meshkit.
"""
