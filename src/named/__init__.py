"""named: write models against axis names; lay them out on a mesh with two small mappings.

``import named as nm`` is the whole public surface.
"""

from . import debug, explicit, inspect, nn, random
from ._axis import (
    ArgumentError,
    ArgumentTypeError,
    Axis,
    AxisError,
    AxisSelection,
    AxisSelector,
    NamedError,
    axis_spec_to_tuple,
)
from ._axis_spec import (
    axis_spec_to_shape_dict,
    concat_axes,
    concat_axis_specs,
    eliminate_axes,
    replace_axis,
    without_axes,
)
from ._core import NamedArray, axes_of, is_named_array, named
from ._einsum import dot, einsum
from ._index import ds, take, updated_slice
from ._numpy import *  # noqa: F403  (the rest of the numpy surface, generated from _numpy.SURFACE)
from ._ops import *  # noqa: F403  (elementwise math and reductions, listed in _ops.__all__)
from ._poly import *  # noqa: F403  (the polynomial family: poly, polyadd, ..., polyfit, roots, vander)
from ._ref import NamedRef, freeze, get, new_ref, swap
from ._remat import ScanCheckpointPolicy, tree_checkpoint_name
from ._shape import (
    arange,
    broadcast_axis,
    broadcast_to,
    concatenate,
    flatten_axes,
    full,
    full_like,
    geomspace,
    linspace,
    logspace,
    one_hot,
    ones,
    ones_like,
    pad,
    rearrange,
    rename,
    roll,
    split,
    stack,
    top_k,
    tril,
    triu,
    unbind,
    unflatten_axis,
    zeros,
    zeros_like,
)
from ._state_dict import (
    FileWriteError,
    StateDictEntry,
    StateDictError,
    flatten_modules_for_export,
    load_state_dict,
    load_state_dict_file,
    save_safetensors,
    save_state_dict,
    square_keys,
    stack_state_dict,
    state_dict,
    state_dict_entries,
    unflatten_modules_from_export,
    unstack_state_dict,
)
from ._transforms import fold, grad, map, nmap, scan, value_and_grad, vmap
from ._tree import resize_axis, tree_map_layers
from ._typing import Bool, Float, Int, Named, bf16, f16, f32, f64, i8, i16, i32, i64, typecheck, u8, u16, u32, u64
from .explicit import (
    ShardedAxis,
    Unreduced,
    UnreducedError,
    all_gather,
    all_to_all,
    axis_index,
    einsum_unreduced,
    pmax,
    pmean,
    psum,
    psum_scatter,
    shard_map,
    with_layout,
)
from .inspect import compiled_report, layout, param_report, parse_layout
from .partitioning import (
    ResourceMapping,
    ShardingCheck,
    ShardingError,
    axis_mapping,
    check_mapping,
    check_sharding,
    current_mapping,
    current_mesh,
    field,
    infer_shardings,
    make_mesh,
    mesh_sizes,
    named_jit,
    pspec_for,
    set_mesh,
    shard,
    sharding_for,
)

__version__ = "0.1.0"
