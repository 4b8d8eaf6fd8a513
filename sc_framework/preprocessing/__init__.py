"""Host preprocessing: raw ids -> fixed-shape, device-ready buffers per stack."""

from sc_framework.preprocessing._batch import PreprocessedBatch, StackBatch, StackSignature
from sc_framework.preprocessing._inputs import (
    DenseIds,
    FeatureInput,
    FlatIds,
    RaggedIds,
    RaggedRows,
    SparseIds,
    flatten_input,
)
from sc_framework.preprocessing._kept import kept_id_masks
from sc_framework.preprocessing._preprocess import (
    PaddingId,
    batch_stats,
    collect_stats,
    padding_id_of,
    preprocess,
)
from sc_framework.preprocessing._scratch import release as release_scratch_buffers
from sc_framework.preprocessing._stats import (
    PartitionOverflowError,
    PreprocessStats,
    StackCapacity,
    StackStats,
    merge_stats,
    size_limits_from_stats,
    stack_capacities,
)

__all__ = [
    "PaddingId",
    "padding_id_of",
    "StackBatch",
    "StackSignature",
    "PreprocessedBatch",
    "DenseIds",
    "RaggedIds",
    "RaggedRows",
    "SparseIds",
    "FlatIds",
    "FeatureInput",
    "flatten_input",
    "preprocess",
    "kept_id_masks",
    "release_scratch_buffers",
    "batch_stats",
    "collect_stats",
    "PreprocessStats",
    "StackStats",
    "StackCapacity",
    "PartitionOverflowError",
    "merge_stats",
    "stack_capacities",
    "size_limits_from_stats",
]
