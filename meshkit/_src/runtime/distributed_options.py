"""``jax.distributed.initialize``'s timeouts, as `meshkit.init` passes them.

Each comes from the argument, else its environment variable, else JAX's default; a JAX without
the parameter is an error raised before joining.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..core import env as _env
from ..core.contract import ENV_HEARTBEAT_TIMEOUT, ENV_SHUTDOWN_TIMEOUT
from ..core.errors import MeshkitError

# meshkit's name -> (jax.distributed.initialize's parameter, environment variable).
OPTIONS = {
    "heartbeat_timeout": ("heartbeat_timeout_seconds", ENV_HEARTBEAT_TIMEOUT),
    "shutdown_timeout": ("shutdown_timeout_seconds", ENV_SHUTDOWN_TIMEOUT),
}
INITIALIZATION = "initialization_timeout"
JAX_CHECKED = "JAX 0.10.2 and 0.12"

_BAD_VALUE = """\
meshkit.init(): {name} must be a whole number of seconds >= 1; got {value!r}{origin}.
JAX's jax.distributed.initialize takes it as {parameter}, in whole seconds.
Consider {name}=SECONDS, e.g. {name}=120."""

_UNSUPPORTED = f"""\
meshkit.init({{name}}=...): the running JAX {{version}} has no {{parameter}} parameter in
jax.distributed.initialize, so it cannot be passed{{origin}}.
{JAX_CHECKED} have it.
Consider installing one of those JAX versions, or leaving {{name}} unset (JAX then keeps its own
default)."""


def _origin(variable: str | None) -> str:
    return f" (from the environment variable {variable})" if variable else ""


def chosen(**given: Any) -> dict[str, Any]:
    """The options to pass, as ``{jax parameter: seconds}``, from arguments else environment."""
    options = {}
    for name, (parameter, variable) in OPTIONS.items():
        value, origin = given.get(name), None
        if value is None:
            value, origin = _env.integer(variable, where="meshkit.init()"), variable
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = {"name": name, "value": value, "origin": _origin(origin), "parameter": parameter}
            raise MeshkitError(_BAD_VALUE.format(**what))
        options[parameter] = value
    return options


def _parameters(initialize: Callable[..., Any]) -> set[str]:
    everything = {p for p, _ in OPTIONS.values()} | {INITIALIZATION}
    try:
        parameters = inspect.signature(initialize).parameters
    except (TypeError, ValueError):  # no signature to read: let JAX itself judge the call
        return everything
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return everything  # a wrapper (a test's spy, a framework's) that passes keywords on
    return set(parameters)


def check_supported(
    options: dict[str, int], initialize: Callable[..., Any] | None = None, version: str = ""
) -> None:
    """Raise if the running JAX's ``jax.distributed.initialize`` lacks one of ``options``."""
    if initialize is None:
        import jax

        initialize, version = jax.distributed.initialize, jax.__version__
    accepted = _parameters(initialize)
    by_parameter = {p: (name, variable) for name, (p, variable) in OPTIONS.items()}
    for parameter in [INITIALIZATION, *options]:
        if parameter in accepted:
            continue
        name, variable = by_parameter.get(parameter, ("timeout", None))
        origin = _origin(variable) if _env.raw(variable or "") is not None else ""
        text = _UNSUPPORTED.format(name=name, version=version, parameter=parameter, origin=origin)
        raise MeshkitError(text)
