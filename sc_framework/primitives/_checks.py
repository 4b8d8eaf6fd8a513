"""Checks of the primitives' arguments against the plan, run while tracing.

Shapes are static under jit, so these checks cost nothing per step. They turn
a wrong table, a batch preprocessed for another layout or a misspelled
feature into an error naming the stack or feature and both values, instead
of an internal JAX error or silently wrong activations.

Expected shapes (G devices, N = G * S shards, V_s rows and D' columns of a
stack, see sc_framework/stacking/_layout.py):
  table         [V_s, D']
  slot          [V_s, D'] (SlotSpec.width None) or [V_s, width]
  stacked       [G * B_s, D'] per stack (stacked activations or their gradients)
  StackBatch    unique_rows [G, N, U]; entry_samples, entry_unique_index,
                entry_gains [G, E] (U and E: the batch's capacities), and its
                signature (static metadata) equal to the plan's stack's
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sc_framework.preprocessing._batch import StackBatch, StackSignature
from sc_framework.primitives._plan import EmbeddingPlan

_PREPROCESS_HINT = (
    "Preprocess the raw ids with sc_framework.preprocessing.preprocess(features, feature_specs,"
    " plan.layout)."
)


def check_names(what: str, given: Iterable[str], expected: Iterable[str], kind: str,
                hint: str) -> None:
  """Raises ValueError unless `given` (a mapping) names exactly the `expected` stacks or features.

  Raises:
    TypeError: `given` is not a mapping (an array, a list).
  """
  if not isinstance(given, Mapping):
    raise TypeError(
        f"{what} must be a dict keyed by {kind[:-1]} name, got {type(given).__name__}. {hint}")
  given, expected = set(given), set(expected)
  missing, unknown = sorted(expected - given), sorted(given - expected)
  if missing or unknown:
    raise ValueError(
        f"{what} has {kind} {sorted(given)} but the plan has {sorted(expected)} (missing"
        f" {missing}, unknown {unknown}). {hint}"
    )


def check_not_in_shard_map(plan: EmbeddingPlan) -> None:
  """Refuses a call inside a shard_map body: there every array is one device's block,
  while the primitives take the global arrays and shard over `plan.mesh` themselves."""
  get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  manual = getattr(get_abstract_mesh(), "manual_axes", ()) if get_abstract_mesh else ()
  if manual:
    raise ValueError(
        f"the embedding primitives were called inside shard_map (manual mesh axes"
        f" {list(manual)}): they take the global tables and batch and shard them over the"
        f" plan's mesh axis {plan.axis_name!r} themselves, with a shard_map of their own. Call"
        " them outside shard_map (under jit is fine), on the global arrays."
    )


def check_tables(plan: EmbeddingPlan, tables: Mapping[str, Any], what: str = "tables") -> None:
  """Every stack's table is present and shaped [V_s, D'] (outside any shard_map)."""
  check_not_in_shard_map(plan)
  if not isinstance(tables, Mapping):
    raise TypeError(f"{what} must map stack names to stacked tables, got {type(tables).__name__}.")
  check_names(what, tables, plan.layout.stack_names, "stacks",
              "Pass the tables of init_embedding_variables(plan, ...) or of a restore into"
              " this plan's layout.")
  for stack in plan.layout.stacks:
    shape = tuple(getattr(tables[stack.name], "shape", ()))
    _check_floating(tables[stack.name], f"{what}[{stack.name!r}]")
    if shape != stack.shape:
      raise ValueError(
          f"{what}[{stack.name!r}] has shape {shape} but stack {stack.name!r} of the plan's"
          f" layout is {stack.shape} (V_s rows, D' columns: tables {list(stack.table_names)}"
          f" over {stack.num_shards} shards). The tables belong to another layout: restore or"
          " convert them into this one (sc_framework.stacking / the checkpoint converter)."
      )


def check_variables(plan: EmbeddingPlan, variables: Any) -> None:
  """Tables as `check_tables`, and every stack's optimizer slots by their SlotSpec."""
  if not (hasattr(variables, "tables") and hasattr(variables, "slots")):
    raise TypeError(
        f"variables must be the EmbeddingVariables (tables and their optimizer slots), got"
        f" {type(variables).__name__}. Pass the variables of init_embedding_variables(plan,"
        " ...) or of a restore, not only their tables.")
  check_tables(plan, variables.tables, "variables.tables")
  slot_specs = plan.slot_specs()
  check_names("variables.slots", variables.slots, slot_specs, "stacks",
              "Pass the variables of init_embedding_variables(plan, ...).")
  for stack in plan.layout.stacks:
    slots = variables.slots[stack.name]
    specs = {spec.name: spec for spec in slot_specs[stack.name]}
    check_names(f"variables.slots[{stack.name!r}]", slots, specs, "slots",
                f"Stack {stack.name!r} is trained with {type(plan.optimizer(stack.name)).__name__},"
                " whose slots these are not; initialise or restore them for this optimizer.")
    for name, spec in specs.items():
      expected = (stack.shape[0], stack.shape[1] if spec.width is None else spec.width)
      shape = tuple(getattr(slots[name], "shape", ()))
      _check_floating(slots[name], f"variables.slots[{stack.name!r}][{name!r}]")
      if shape != expected:
        raise ValueError(
            f"variables.slots[{stack.name!r}][{name!r}] has shape {shape} but the optimizer's"
            f" slot {name!r} of stack {stack.name!r} is {expected}. The slots belong to another"
            " layout or optimizer: restore or convert them into this plan's layout."
        )


def check_stacked(plan: EmbeddingPlan, stacked: dict[str, jax.Array], what: str,
                   hint: str) -> None:
  """`stacked` holds one [G * B_s, D'] array per stack of the plan (`stacked_lookup`'s form)."""
  check_not_in_shard_map(plan)
  check_names(what, stacked, plan.layout.stack_names, "stacks", hint)
  for stack in plan.layout.stacks:
    shape = _shape_of(stacked[stack.name], f"{what}[{stack.name!r}]")
    expected = (stack.total_batch_size, stack.padded_embedding_dim)
    if shape != expected:
      raise ValueError(
          f"{what}[{stack.name!r}] has shape {shape} but stack {stack.name!r} holds"
          f" {expected}: the samples of its features {[f.name for f in stack.features]} over"
          f" the batch, {stack.padded_embedding_dim} columns. {hint}"
      )


def _check_floating(array: Any, what: str) -> None:
  """Tables and slots are floating point: integer ones would be looked up and updated
  with every value truncated, silently (quantized tables are not supported)."""
  dtype = getattr(array, "dtype", None)
  if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"{what} has dtype {np.dtype(dtype).name}; tables and slots must be floating point"
        " (float32, or bfloat16 tables): integer tables would have every activation and"
        " update truncated. Keep them in float32 (or bfloat16) for training."
    )


def _shape_of(array: Any, what: str) -> tuple[int, ...]:
  """The shape of a floating-point array argument; TypeError naming it for anything else
  (None, a list, integers: activations and their gradients are never integers, and a
  cast of them would be silent)."""
  if not hasattr(array, "shape") or not hasattr(array, "dtype"):
    raise TypeError(f"{what} must be an array, got {type(array).__name__}.")
  if not jnp.issubdtype(array.dtype, jnp.floating):
    raise TypeError(
        f"{what} has dtype {np.dtype(array.dtype).name}; it must be floating point (float32,"
        " bfloat16, ...): pass the values the model computed, not integers."
    )
  return tuple(array.shape)


def check_features(plan: EmbeddingPlan, arrays: Any, what: str) -> None:
  """One array per feature of the plan, each of its feature's output_shape."""
  check_names(what, arrays, [f.name for f in plan.feature_specs], "features",
              "Pass one array per feature of the plan, keyed by feature name.")
  for feature in plan.feature_specs:
    shape = _shape_of(arrays[feature.name], f"{what}[{feature.name!r}]")
    if shape != feature.output_shape:
      raise ValueError(
          f"{what}[{feature.name!r}] has shape {shape} but the feature's output_shape is"
          f" {feature.output_shape}; pass arrays with the activations' shape."
      )


def check_step(step: Any) -> None:
  """`step` is an integer scalar in [0, 2^31): the number of updates applied so far.

  Its value is checked when it is on the host (a Python or numpy int): a
  negative step would give Adam a zero bias correction, a float one would
  be cut silently. A jax array's dtype and shape are checked, never its
  value, which would wait for the device.
  """
  hint = ("step is the number of updates applied so far: pass a Python int or an integer"
          " scalar array (e.g. the state's int32 step counter), 0 for the first update.")
  if isinstance(step, (bool, np.bool_)):
    raise TypeError(f"step must be an integer scalar, got the bool {step!r}. {hint}")
  if not isinstance(step, int):
    dtype = getattr(step, "dtype", None)
    if dtype is None or np.shape(step) != () or not np.issubdtype(dtype, np.integer):
      described = (f"an array of dtype {dtype} and shape {np.shape(step)}" if dtype is not None
                   else f"{type(step).__name__} {step!r}")
      raise TypeError(f"step must be an integer scalar, got {described}. {hint}")
    if isinstance(step, jax.Array):  # traced, or on a device
      return
  value = int(step)
  if not 0 <= value < 2**31:
    raise ValueError(f"step must be in [0, 2^31), got {value}. {hint}")


def check_batch(plan: EmbeddingPlan, batch: Mapping[str, Any], what: str = "batch",
                type_hint: str = "") -> None:
  """One StackBatch per stack, shaped for the plan's G devices and N shards.

  `type_hint` ends the message of a batch that is not preprocessed at all.
  """
  if not isinstance(batch, Mapping):
    raise TypeError(
        f"{what} must be the preprocessed batch, a dict stack name -> StackBatch, got"
        f" {type(batch).__name__}. {_PREPROCESS_HINT}{type_hint}"
    )
  other = {name: type(value).__name__ for name, value in batch.items()
           if not isinstance(value, StackBatch)}
  if other:
    raise TypeError(
        f"{what} must be the preprocessed batch, a dict stack name -> StackBatch, got values"
        f" {other}. {_PREPROCESS_HINT}{type_hint}"
    )
  check_names(what, batch, plan.layout.stack_names, "stacks", _PREPROCESS_HINT)
  devices = plan.num_devices
  for stack in plan.layout.stacks:
    sparse = batch[stack.name]
    rows = tuple(sparse.unique_rows.shape)
    entries = [tuple(getattr(sparse, field).shape)
               for field in ("entry_samples", "entry_unique_index", "entry_gains")]
    if (len(rows) != 3 or rows[:2] != (devices, stack.num_shards)
        or any(len(shape) != 2 or shape != entries[0] or shape[0] != devices
               for shape in entries)):
      raise ValueError(
          f"{what}[{stack.name!r}] was preprocessed for another layout: unique_rows has shape"
          f" {rows} and the entry arrays {entries}, but the plan has G={devices} devices and"
          f" N={stack.num_shards} shards (unique_rows [G, N, U], entries [G, E]). Preprocess"
          " with this plan's layout (plan.layout)."
      )
    _check_dtypes(stack, sparse, what)
    _check_signature(plan, stack, sparse, what)
    _check_batch_values(plan, stack, sparse, what)


_INDEX_FIELDS = ("unique_rows", "entry_samples", "entry_unique_index")


def _check_dtypes(stack, sparse: StackBatch, what: str) -> None:
  """Row, sample and index buffers are signed integers of 32 bits or more; gains floats.

  A batch cast with a model's dtype (float indices) failed deep inside JAX, and
  one cast to a narrow or unsigned integer (uint8: -1 becomes 255) looked up
  other rows silently.
  """
  wrong = []
  for field in _INDEX_FIELDS:
    dtype = np.dtype(getattr(sparse, field).dtype)
    if not jnp.issubdtype(dtype, jnp.signedinteger) or dtype.itemsize < 4:
      wrong.append(f"{field} is {dtype.name}")
  gains = np.dtype(sparse.entry_gains.dtype)
  if not jnp.issubdtype(gains, jnp.floating):
    wrong.append(f"entry_gains is {gains.name}")
  if wrong:
    raise TypeError(
        f"{what}[{stack.name!r}]: " + ", ".join(wrong) + "; the row, sample and index"
        " buffers must be int32 (or int64) and entry_gains a float, as preprocess makes"
        " them. Do not cast the preprocessed batch (e.g. to the model's dtype): cast only the"
        " dense inputs."
    )


def _signature_differences(got: StackSignature, want: StackSignature) -> list[str]:
  """What differs between a batch's signature and the plan's, "<what> <got> vs <want>"."""
  out = []
  explained = False  # what a batch_size counts, said at the first that differs

  def differ(what, a, b):
    if a != b:
      out.append(f"{what} {a!r} (batch) vs {b!r} (plan)")

  differ("stack", got.stack, want.stack)
  differ("devices G", got.num_devices, want.num_devices)
  differ("shards N", got.num_shards, want.num_shards)
  differ("rows per shard R", got.rows_per_shard, want.rows_per_shard)
  for kind, columns, a, b in (
      ("table", ("vocabulary_size", "row_offset", "shard_rotation"), got.tables, want.tables),
      ("feature", ("table", "batch_size", "sample_offset"), got.features, want.features)):
    a_rows, b_rows = {row[0]: row[1:] for row in a}, {row[0]: row[1:] for row in b}
    differ(f"{kind}s", [row[0] for row in a], [row[0] for row in b])
    for name in [name for name in a_rows if name in b_rows]:
      for column, x, y in zip(columns, a_rows[name], b_rows[name]):
        differ(f"{kind} {name!r} {column}", x, y)
        if column == "batch_size" and x != y and not explained:
          out[-1] += (" (a batch_size counts stacked samples: the batch, times L for a"
                      " sequence feature)")
          explained = True
  differ("combiner", got.combiner, want.combiner)
  differ("sequence features", list(got.sequence_features), list(want.sequence_features))
  return out


def _check_signature(plan: EmbeddingPlan, stack, sparse: StackBatch, what: str) -> None:
  """The batch was preprocessed for the plan's stack (its static signature; also under jit).

  A batch without a signature (built by hand) is checked by shapes and, on
  the host, by values only.
  """
  got = sparse.signature
  if got is None:
    return
  want = plan.batch_signature(stack.name)
  if got == want:
    return
  differences = _signature_differences(got, want) or [f"{got!r} (batch) vs {want!r} (plan)"]
  shown = differences[:8] + ([f"and {len(differences) - 8} more"] if len(differences) > 8 else [])
  raise ValueError(
      f"{what}[{stack.name!r}] was preprocessed for another layout than the plan's stack"
      f" {stack.name!r} (tables {list(stack.table_names)}): " + "; ".join(shown) + "."
      " Its buffers would address other rows, samples or gains (wrong or zero activations, lost"
      " updates). Preprocess with this plan's layout (plan.layout) and the feature specs it"
      " was built from."
  )


def _check_buffer_ranges(sparse: StackBatch, what: str, stack_name: str) -> None:
  """A host batch's buffers hold only values preprocess writes (not so a batch built or
  edited by hand): unique rows >= -1 (-1: unused), samples >= 0, unique indices in
  [0, N * U) (the device's flattened unique rows) and finite gains. The kernels would
  skip such entries, or spread a NaN, silently."""
  rows, samples, index = sparse.unique_rows, sparse.entry_samples, sparse.entry_unique_index
  if not all(isinstance(array, np.ndarray) for array in (rows, samples, index)):
    return  # Traced (under jit) or on the devices: nothing to read cheaply.
  unique = int(np.prod(rows.shape[1:]))
  problems = []
  if rows.size and int(rows.min()) < -1:
    problems.append(f"unique_rows holds {int(rows.min())} (rows are >= 0, -1 for unused)")
  if samples.size and int(samples.min()) < 0:
    problems.append(f"entry_samples holds {int(samples.min())} (samples are >= 0)")
  if index.size and (int(index.min()) < 0 or int(index.max()) >= unique):
    bad = int(index.min()) if int(index.min()) < 0 else int(index.max())
    problems.append(f"entry_unique_index holds {bad}, outside [0, N * U = {unique})")
  gains = sparse.entry_gains
  if isinstance(gains, np.ndarray) and not np.isfinite(gains).all():
    problems.append("entry_gains holds a non-finite value")
  if problems:
    raise ValueError(
        f"{what}[{stack_name!r}]: " + "; ".join(problems) + ". preprocess never writes such"
        " values: the batch was built or edited by hand. Build it with preprocess."
    )


def _check_batch_values(plan: EmbeddingPlan, stack, sparse: StackBatch, what: str) -> None:
  """A host (numpy) batch's rows and samples fit the stack (eager calls only).

  A batch preprocessed for a layout of the same G and N but other vocabularies
  or batch sizes has the plan's shapes; its rows beyond the shards' R rows, or
  samples beyond the devices' B_loc, would be skipped silently (zero
  activations, no update). Under jit the arrays are tracers: nothing to read.
  """
  _check_buffer_ranges(sparse, what, stack.name)
  rows, samples = sparse.unique_rows, sparse.entry_samples
  local_batch = stack.total_batch_size // plan.num_devices
  problems = []
  if isinstance(rows, np.ndarray) and rows.size and int(rows.max()) >= stack.rows_per_shard:
    problems.append(f"local row {int(rows.max())}, but its shards hold"
                    f" R={stack.rows_per_shard} rows (other vocabularies)")
  if isinstance(samples, np.ndarray) and samples.size and int(samples.max()) > local_batch:
    problems.append(f"local sample {int(samples.max())}, but each device holds"
                    f" {local_batch} samples of the stack (other batch sizes)")
  if problems:
    raise ValueError(
        f"{what}[{stack.name!r}] was preprocessed for another layout: it holds "
        + "; ".join(problems) + f" in the plan's stack {stack.name!r} (tables"
        f" {list(stack.table_names)}). Preprocess with this plan's layout (plan.layout) and"
        " the feature specs it was built from."
    )
