"""Device-side primitives: sparse lookup and the fused sparse update."""

from sc_framework.primitives._api import (
    apply_embedding_gradients,
    apply_stacked_gradients,
    embedding_lookup,
    split_stacked_activations,
    stack_activations,
    stacked_lookup,
)
from sc_framework.primitives._backend import (
    CPU_BACKEND,
    XLA_BACKEND,
    EmbeddingBackend,
    PortableCpuBackendWarning,
    available_backends,
    get_backend,
    register_backend,
    registered_backends,
)
from sc_framework.primitives._plan import (
    DEFAULT_AXIS_NAME,
    EmbeddingPlan,
    check_devices_per_process,
    default_mesh,
    mesh_axis_size,
    process_major_devices,
)
from sc_framework.primitives._row_ops import cpu_kernels_build
from sc_framework.primitives._state import (
    EmbeddingVariables,
    embedding_variable_shapes,
    init_embedding_variables,
    table_seed,
)
from sc_framework.primitives._tables import replace_tables, slot_values, table_values

__all__ = [
    "EmbeddingPlan",
    "EmbeddingVariables",
    "DEFAULT_AXIS_NAME",
    "check_devices_per_process",
    "process_major_devices",
    "default_mesh",
    "mesh_axis_size",
    "init_embedding_variables",
    "embedding_variable_shapes",
    "table_seed",
    "table_values",
    "slot_values",
    "replace_tables",
    "embedding_lookup",
    "stacked_lookup",
    "split_stacked_activations",
    "stack_activations",
    "apply_embedding_gradients",
    "apply_stacked_gradients",
    "EmbeddingBackend",
    "PortableCpuBackendWarning",
    "XLA_BACKEND",
    "CPU_BACKEND",
    "register_backend",
    "available_backends",
    "get_backend",
    "registered_backends",
    "cpu_kernels_build",
]
