"""Table stacking and the persisted, sharded layout."""

from sc_framework.stacking._choice import Stacking, layout_for_stacking, normalize_stacking
from sc_framework.stacking._grouping import (
    auto_stack_tables,
    check_layout_fits_specs,
    stack_name,
    stack_tables,
    stacking_key,
    unstacked_layout,
)
from sc_framework.stacking._host import device_block, stack, stack_block, unstack
from sc_framework.stacking._layout import (
    EmbeddingLayout,
    FeaturePlacement,
    StackLayout,
    TablePlacement,
    check_layout,
    check_rows_addressable,
    round_up,
)
from sc_framework.stacking._rows import (
    device_of_global_row,
    device_row_range,
    global_to_logical_rows,
    is_padding_row,
    logical_rows_in_shard,
    logical_progression_to_global,
    logical_to_global_rows,
    shard_of_global_row,
    shard_row_range,
    table_row_runs_in_block,
    table_rows_in_block,
)

__all__ = [
    "EmbeddingLayout",
    "StackLayout",
    "TablePlacement",
    "FeaturePlacement",
    "auto_stack_tables",
    "stack_tables",
    "Stacking",
    "layout_for_stacking",
    "normalize_stacking",
    "unstacked_layout",
    "stack_name",
    "stacking_key",
    "check_layout",
    "check_layout_fits_specs",
    "check_rows_addressable",
    "round_up",
    "stack",
    "unstack",
    "stack_block",
    "device_block",
    "logical_to_global_rows",
    "logical_progression_to_global",
    "logical_rows_in_shard",
    "global_to_logical_rows",
    "is_padding_row",
    "shard_of_global_row",
    "device_of_global_row",
    "shard_row_range",
    "device_row_range",
    "table_rows_in_block",
    "table_row_runs_in_block",
]
