"""The rules of ``meshkit migrate``: a stable code, what breaks or costs, and the replacement.

The texts state what JAX 0.10.2 and 0.12 (the lines meshkit tests) do; each was checked against
them or measured by the meshkit team. Codes are stable: a rule that goes away keeps its number
retired, a new rule takes the next one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One legacy pattern.

    Attributes:
        code: the stable code (``MK001`` ...), used in reports and ``# meshkit: ignore[...]``.
        name: a few words naming the pattern.
        why: what breaks or costs in today's JAX.
        fix: the meshkit replacement, or what to do by hand.
    """

    code: str
    name: str
    why: str
    fix: str


_PMAP_WHY = (
    "jax.pmap now runs through jit(shard_map); in multi-process runs its outputs are "
    "host-local arrays, so a later jax.jit takes each process's part for the whole value and "
    "checkpointers refuse them."
)
_PMAP_FIX = (
    "meshkit.pmap_compat, the same signature, collectives and outputs (host-local arrays in "
    "multi-process runs, so host reads give what they gave). Pass global_outputs=True for global "
    "arrays that a later jax.jit and checkpointers see whole."
)
_NESTED_WHY = (
    "Nested jax.pmap was removed from JAX: JAX 0.10.2 and 0.12 fail with 'The context mesh ... "
    "should match the mesh passed to shard_map'."
)
_NESTED_FIX = (
    "meshkit.pmap_compat at both levels: the inner axis runs vectorized on each device of the "
    "outer one, and collectives may name either axis or both."
)
_NEGATIVE_WHY = (
    "jax.pmap places a negative out_axes wrongly and raises no error: 8 per-device outputs of "
    "shape (2,) with out_axes=-1 come back as (16, 1) instead of (2, 8)."
)
_NEGATIVE_FIX = (
    "meshkit.pmap_compat counts out_axes from the end, as jax.vmap does. Not rewritten by --fix: "
    "change it by hand and check the code that reads this output, which may have been written "
    "around the wrong layout."
)
_NONE_WHY = (
    "jax.pmap with out_axes=None returns device 0's value without checking that the devices "
    "agree: a value that differs across devices is silently wrong."
)
_NONE_FIX = (
    "meshkit.pmap_compat takes the same out_axes (None, or None entries such as (None, 0)) and "
    "checks at trace time that such an output is the same on every device, naming it "
    "otherwise: --fix rewrites the pmap (MK001); if it then names an output, reduce the value "
    "(jax.lax.pmean, psum) before returning it. A None output is one value, not one entry per "
    "device: reading it on the host is not an MK010 finding."
)
_FLAX_WHY = (
    "What flax.jax_utils does depends on the Flax release: some build on "
    "jax.device_put_replicated / device_put_sharded, which JAX 0.10 removed; current ones place "
    "arrays over this process's devices only, host-local in multi-process runs."
)
_FLAX_FIX = "meshkit's function of the same name and signature; no Flax needed."
_COMMON_WHY = (
    "A pmap-era Flax helper that shapes data by jax.local_device_count() (get_metrics: takes "
    "device 0's entry of every metric). It still works; meshkit's copy has the same signature, "
    "so the program no longer needs flax.training for it."
)
_COMMON_FIX = "meshkit's function of the same name and signature."
_DEVICE_PUT_WHY = (
    "Removed from JAX: jax.device_put_replicated and jax.device_put_sharded raise "
    "AttributeError in JAX 0.10.2 and 0.12 (ImportError through `from jax import ...`)."
)
_DEVICE_PUT_FIX = "meshkit.device_put_replicated / meshkit.device_put_sharded, the same signature."
_PMAP_SHARDING_WHY = (
    "PmapSharding is jax.pmap's legacy sharding: JAX 0.10.2 and 0.12 no longer provide it "
    "(`from jax.sharding import PmapSharding` raises ImportError), and jax.pmap outputs carry a "
    "NamedSharding."
)
_PMAP_SHARDING_FIX = (
    "NamedSharding(mesh, PartitionSpec(axis)) over a Mesh (meshkit.make_mesh); a check of "
    "isinstance(x.sharding, PmapSharding) becomes one of NamedSharding and its spec. Not "
    "rewritten by --fix."
)
_MERGE_WHY = (
    "jax_pmap_shmap_merge is the config flag of jax.pmap's move onto shard_map, a transition "
    "setting: JAX 0.10.2 and 0.12 no longer define it (jax.config.update raises AttributeError "
    "'Unrecognized config option')."
)
_MERGE_FIX = (
    "Remove it once the code runs on meshkit.pmap_compat, which does not depend on it. Not "
    "rewritten by --fix."
)
_INDEX_WHY = (
    "A value with one entry per device (a pmap output, or what replicate / shard made) read "
    "on the host: x[k], tree_map(lambda a: a[0], x), np.asarray(x), jax.device_get(x), "
    "float(x), x.item(), wherever the value flowed (names, tuple unpacking, attributes, fields, "
    "returns, lists, helpers in other files of the run). With meshkit.pmap_compat's defaults "
    "it reads this process's entries, as jax.pmap did; with global_outputs=True the value is "
    "a global array, and in a multi-process run no process holds every entry, so the read "
    "fails or gives another process's. x[0] also gathers the whole array to read one entry "
    "(3.3 ms for 8 MiB on 8 CPU devices, where one shard takes microseconds)."
)
_INDEX_FIX = (
    "--fix rewrites x[0] and tree_map(lambda a: a[0], x) to meshkit.unreplicate(x) (this "
    "process's first entry, read from its own shard, in both modes; numpy gives x[0]), and "
    "np.asarray(x), np.array(x) and jax.device_get(x) to meshkit.local_from_global(x) (this "
    "process's entries, in both modes; a numpy array, such as shard of a numpy batch, is "
    "given back as it is, uncopied). The same numbers as before with the defaults. Other "
    "reads need a person: meshkit.gather(x) for every process's entries, or reduce on device "
    "first (jax.lax.pmean) and read one entry."
)
_AOT_WHY = (
    "An ahead-of-time compiled pmap: from jax.pmap, the Compiled object cannot be called in "
    "multi-process runs (it has no host-local to global conversion) and takes only the shapes "
    "and shardings it was lowered for."
)
_AOT_FIX = (
    "meshkit.pmap_compat's .lower(...).compile() is called with the pmapped function's "
    "arguments in any process count; or call the pmapped function itself (it compiles once per "
    "signature and caches). Not rewritten by --fix."
)

_REMOVED_WHY = (
    "JAX 0.10.2 and 0.12 no longer have it (each was checked on both): the line fails with "
    "AttributeError when it runs, or with ImportError at import time for an import, so a file "
    "with no pmap left may still not run."
)
_REMOVED_FIX = (
    "The replacement the finding names: jax.tree.* for jax.tree_*, jax.sharding for the old "
    "sharding names, jax.Array for the old array types. --fix rewrites the names that have a "
    "one-to-one replacement (a removed name imported with from-import is then used through "
    "jax.); the others, and imports of removed modules, need an edit by hand."
)

_SHARD_MAP_WHY = (
    "jax.experimental.shard_map is deprecated since JAX 0.8 (a DeprecationWarning on use; in "
    "JAX 0.12 a shim that calls jax.shard_map with check_vma=check_rep). jax.shard_map takes "
    "mesh, in_specs and out_specs as keywords only."
)
_SHARD_MAP_FIX = (
    "jax.shard_map: --fix rewrites the reference, names the positional mesh, in_specs, "
    "out_specs and check_rep (as check_vma), and drops the old import; auto= and arguments "
    "passed with * or ** are left to a person."
)
_CHECK_REP_WHY = (
    "jax.shard_map has no check_rep: JAX renamed it check_vma (its replication checking became "
    "varying-manual-axes typing), and passing check_rep raises TypeError."
)
_CHECK_REP_FIX = (
    "check_vma= with the same value (--fix renames a keyword written at the call, whatever its "
    "value); a check_rep key of a dict passed with ** is reported, to rename where it is built."
)
_MESH_CONTEXT_WHY = (
    "JAX's mesh context moved to jax.set_mesh: jax.sharding.use_mesh is gone (AttributeError in "
    "JAX 0.12), and `with mesh:` is deprecated (a DeprecationWarning; a RuntimeError with "
    "jax_disallow_mesh_context_manager)."
)
_MESH_CONTEXT_FIX = (
    "jax.set_mesh(mesh), as a context manager (`with jax.set_mesh(mesh):`) or a call: --fix "
    "rewrites use_mesh and a `with` of a name bound to a new Mesh (jax.sharding.Mesh, "
    "jax.make_mesh, meshkit.make_mesh) or annotated Mesh; `with ... as m:` is left to a person."
)
_TPU_INIT_WHY = (
    "jax.cloud_tpu_init was removed from JAX (AttributeError in JAX 0.12): JAX initializes "
    "Cloud TPUs itself when its backend starts."
)
_TPU_INIT_FIX = (
    "Delete the call: --fix deletes one that stands alone as a statement (and its import when "
    "nothing else uses it); any other use is left to a person."
)
_PMAP_WRAPPER_WHY = (
    "A library's pmap (flax nnx.pmap, equinox filter_pmap) is built on jax.pmap and inherits "
    "it: host-local outputs in multi-process runs, no nested pmap; meshkit.pmap_compat does not "
    "stand in for it, since it splits and merges the library's modules and filters."
)
_PMAP_WRAPPER_FIX = (
    "Move the step to the library's sharded transforms (nnx.shard_map, or nnx.jit with "
    "shardings; eqx.filter_jit with shardings, or jax.shard_map). Not rewritten by --fix."
)

RULES: dict[str, Rule] = {
    r.code: r
    for r in (
        Rule("MK001", "jax.pmap", _PMAP_WHY, _PMAP_FIX),
        Rule("MK002", "nested pmap", _NESTED_WHY, _NESTED_FIX),
        Rule("MK003", "negative out_axes", _NEGATIVE_WHY, _NEGATIVE_FIX),
        Rule("MK004", "out_axes=None", _NONE_WHY, _NONE_FIX),
        Rule("MK005", "flax.jax_utils helper", _FLAX_WHY, _FLAX_FIX),
        Rule("MK006", "flax common_utils helper", _COMMON_WHY, _COMMON_FIX),
        Rule("MK007", "jax.device_put_replicated/sharded", _DEVICE_PUT_WHY, _DEVICE_PUT_FIX),
        Rule("MK008", "PmapSharding", _PMAP_SHARDING_WHY, _PMAP_SHARDING_FIX),
        Rule("MK009", "jax_pmap_shmap_merge", _MERGE_WHY, _MERGE_FIX),
        Rule("MK010", "host read of a pmap output", _INDEX_WHY, _INDEX_FIX),
        Rule("MK011", ".lower().compile() of a pmap", _AOT_WHY, _AOT_FIX),
        Rule("MK012", "API removed from JAX", _REMOVED_WHY, _REMOVED_FIX),
        Rule("MK013", "jax.experimental.shard_map", _SHARD_MAP_WHY, _SHARD_MAP_FIX),
        Rule("MK014", "check_rep", _CHECK_REP_WHY, _CHECK_REP_FIX),
        Rule("MK015", "mesh context (use_mesh, with mesh)", _MESH_CONTEXT_WHY, _MESH_CONTEXT_FIX),
        Rule("MK016", "jax.cloud_tpu_init", _TPU_INIT_WHY, _TPU_INIT_FIX),
        Rule("MK017", "nnx.pmap / eqx.filter_pmap", _PMAP_WRAPPER_WHY, _PMAP_WRAPPER_FIX),
    )
}

# MK012: what pmap-era code uses that JAX 0.10.2 and 0.12 removed (each checked absent on both):
# qualified name -> (its one-to-one replacement, or None; what to use instead). A module's entry
# also covers every name under it.
_TREE = "jax.tree.{}: the same function"
REMOVED: dict[str, tuple[str | None, str]] = {
    **{
        f"jax.tree_{name}": (f"jax.tree.{name}", _TREE.format(name))
        for name in (
            "map",
            "flatten",
            "leaves",
            "unflatten",
            "structure",
            "transpose",
            "reduce",
            "all",
        )
    },
    "jax.tree_util.tree_multimap": ("jax.tree.map", "jax.tree.map, which takes several trees"),
    "jax.tree_multimap": ("jax.tree.map", "jax.tree.map, which takes several trees"),
    "jax.experimental.optix": (None, "optax (optix's successor: the same transformations)"),
    "jax.lax.infeed": (None, "jax.experimental.io_callback, or feed the data as an argument"),
    "jax.lax.outfeed": (None, "jax.experimental.io_callback or jax.debug.callback"),
    "jax.lib.xla_client": (None, "jax.devices(), jax.jit(f).lower(...) for compiled text"),
    "jax.experimental.PartitionSpec": ("jax.sharding.PartitionSpec", "jax.sharding.PartitionSpec"),
    "jax.random.KeyArray": ("jax.Array", "jax.Array (typed keys: jax.random.key)"),
    "jax.numpy.DeviceArray": ("jax.Array", "jax.Array"),
    "jax.ShapedArray": ("jax.core.ShapedArray", "jax.core.ShapedArray"),
    "jax.experimental.maps": (None, "jax.sharding.Mesh for Mesh; jax.shard_map for xmap"),
    "jax.experimental.global_device_array": (None, "jax.Array (every array is global now)"),
    "jax.interpreters.pxla.ShardedDeviceArray": (None, "jax.Array"),
    "jax.experimental.host_callback": (None, "jax.experimental.io_callback or jax.debug.callback"),
    "jax.experimental.optimizers": (None, "jax.example_libraries.optimizers, or optax"),
    "jax.experimental.stax": (None, "jax.example_libraries.stax, or flax"),
    "jax.xla_computation": (None, "jax.jit(f).lower(*args) and its .as_text()"),
    "jax.linear_util": (None, "jax.extend.linear_util"),
    "jax.abstract_arrays": (None, "jax.core.ShapedArray"),
    "jax.core.axis_frame": (None, "jax.lax.axis_size(name) for the size of a named axis"),
    "jax.core.Primitive": (None, "jax.extend.core.Primitive"),
    "jax.ops.index_update": (None, "x.at[idx].set(y)"),
    "jax.ops.index": (None, "x.at[idx]"),
    "jax.api": (None, "the same names on jax"),
    "jax.lib.xla_bridge": (None, "jax.devices(), jax.default_backend()"),
    "jax.config.FLAGS": (None, "jax.config.values, or jax.config.update"),
}

# MK012 for imports only: names that are still attributes (jax.config.update works) but no
# longer modules, so `import jax.config` and `from jax.config import config` fail.
REMOVED_MODULES: dict[str, str] = {
    "jax.config": "`from jax import config` (jax.config is an object now, not a module)",
}

# The helpers --fix rewrites, by qualified name: (rule, meshkit name, the keyword names a call
# may use and stay a drop-in). The keywords are the legacy signatures, which meshkit keeps;
# a call with any other keyword (e.g. a newer Flax's axis_name=) is reported, not rewritten.
FLAX_JAX_UTILS: dict[str, tuple[str, frozenset[str]]] = {
    "flax.jax_utils.replicate": ("replicate", frozenset({"tree", "devices"})),
    "flax.jax_utils.unreplicate": ("unreplicate", frozenset({"tree"})),
    "flax.jax_utils.prefetch_to_device": (
        "prefetch_to_device",
        frozenset({"iterator", "size", "devices"}),
    ),
    "flax.jax_utils.pad_shard_unpad": (
        "pad_shard_unpad",
        frozenset({"wrapped", "static_argnums", "static_argnames", "static_return"}),
    ),
}
COMMON_UTILS: dict[str, tuple[str, frozenset[str]]] = {
    "flax.training.common_utils.shard": ("shard", frozenset({"xs"})),
    "flax.training.common_utils.shard_prng_key": ("shard_prng_key", frozenset({"prng_key"})),
    "flax.training.common_utils.get_metrics": ("get_metrics", frozenset({"device_metrics"})),
}
DEVICE_PUT: dict[str, tuple[str, frozenset[str]]] = {
    "jax.device_put_replicated": ("device_put_replicated", frozenset({"x", "devices"})),
    "jax.device_put_sharded": ("device_put_sharded", frozenset({"shards", "devices"})),
}
# jax.pmap's keywords (JAX 0.10.2 and 0.12), all of which meshkit.pmap_compat takes.
PMAP_KEYWORDS = frozenset(
    {
        "fun",
        "axis_name",
        "in_axes",
        "out_axes",
        "static_broadcasted_argnums",
        "devices",
        "backend",
        "axis_size",
        "donate_argnums",
    }
)
