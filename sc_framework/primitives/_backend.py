"""Backend dispatch for the lookup and the fused update.

A backend implements `lookup(plan, tables, batch)` and
`apply_gradients(plan, variables, batch, activation_grads, step)` with the
semantics of the portable XLA implementation, and says whether it can run a
plan (`supports`). Callers never name a backend unless they want to: "auto"
picks the first registered backend, in order of registration priority, that
supports the plan, and the portable "xla" backend supports every plan. A
backend is chosen by its registered name or passed as an `EmbeddingBackend`
value (`XLA_BACKEND`, `CPU_BACKEND`, or one of the caller's own, which needs
no registration). The
"cpu" backend (multi-threaded C++ kernels for the row gathers, scatters and
segment sums, through the XLA FFI) is preferred on CPU devices when its
extension was built at install time.

When the devices are CPUs and the C++ kernels were not built (no C++
compiler at install time), "auto" uses the portable backend and warns once
(`PortableCpuBackendWarning`), saying what is slower and how to build them.

A TPU SparseCore backend (delegating to `jax_tpu_embedding` when it imports and
the devices are TPUs) plugs in with `register_backend`; nothing here requires
that package.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

from sc_framework.primitives import _sharded
from sc_framework.primitives._plan import EmbeddingPlan
from sc_framework.primitives._row_ops import CPU_KERNEL_OPS, cpu_kernels_available


@dataclasses.dataclass(frozen=True)
class EmbeddingBackend:
  """One implementation of the embedding primitives.

  Attributes:
    name: the name callers select it by.
    lookup: (plan, tables, batch) -> activations per feature, [S_f, D_f] with
      S_f = FeatureSpec.stacked_batch_size (a sequence feature's B * L
      positions as rows; the public primitive reshapes them to [B, L, D]).
    apply_gradients: (plan, variables, batch, activation_grads, step) ->
      variables, with activation gradients in the same [S_f, D_f] form.
    supports: plan -> whether this backend can run it (e.g. TPU devices only).
    priority: "auto" tries higher priorities first.
    description: a few words for users (e.g. in the Trainer's start-up line).
    lookup_stacks: optional (plan, tables, batch) -> stack name -> the
      stack's activations as one [G * B_s, D'] array (device g's block holds
      its samples of every feature of the stack, feature after feature, in
      the stack's order; `stacked_lookup`). Without it they are joined from
      `lookup`'s result, which costs one copy.
    apply_stacked_gradients: optional (plan, variables, batch, stacked_grads,
      step) -> variables, with the gradients in `lookup_stacks`' form
      (`sc_framework.primitives.apply_stacked_gradients`). Without it they
      are split into features for `apply_gradients`, which costs one copy.
    installed: () -> whether its implementation is present in this
      installation (e.g. the C++ kernels were built); `available_backends`
      lists only installed backends.
  """

  name: str
  lookup: Callable[..., Any]
  apply_gradients: Callable[..., Any]
  supports: Callable[[EmbeddingPlan], bool] = lambda plan: True
  priority: int = 0
  description: str = ""
  lookup_stacks: Callable[..., Any] | None = None
  apply_stacked_gradients: Callable[..., Any] | None = None
  installed: Callable[[], bool] = lambda: True


class PortableCpuBackendWarning(RuntimeWarning):
  """CPU devices run the portable XLA ops because the C++ kernels are not built."""


def _kernels_built() -> bool:
  return importlib.util.find_spec("sc_framework.primitives._cpu_kernels") is not None


@functools.cache
def _warn_portable_on_cpu() -> None:
  """Warns (once per process) that CPU devices use the slower portable ops."""
  warnings.warn(
      "the C++ CPU kernels of sc_framework are not built, so the embedding lookups and"
      " updates on CPU use the portable XLA ops, whose row gathers, scatters and segment sums"
      " are slower than the multi-threaded C++ kernels. To build the kernels, install a C++17"
      " compiler (e.g. `apt-get install g++` or Xcode's command line tools), then reinstall"
      " the package from its source: `pip install -e .` in a checkout, or `pip install"
      " --force-reinstall --no-deps --no-binary sc-framework sc-framework`.",
      PortableCpuBackendWarning,
      stacklevel=3,
  )


def _on_cpu(plan: EmbeddingPlan) -> bool:
  return all(device.platform == "cpu" for device in plan.mesh.devices.flat)


def _all_cpu(plan: EmbeddingPlan) -> bool:
  return _on_cpu(plan) and cpu_kernels_available()


XLA_BACKEND = EmbeddingBackend("xla", _sharded.lookup, _sharded.apply_gradients,
                               lookup_stacks=_sharded.lookup_stacks,
                               apply_stacked_gradients=_sharded.apply_stacked_gradients,
                               priority=0,
                               description="portable XLA ops")
CPU_BACKEND = EmbeddingBackend(
    "cpu",
    functools.partial(_sharded.lookup, ops=CPU_KERNEL_OPS),
    functools.partial(_sharded.apply_gradients, ops=CPU_KERNEL_OPS),
    lookup_stacks=functools.partial(_sharded.lookup_stacks, ops=CPU_KERNEL_OPS),
    apply_stacked_gradients=functools.partial(_sharded.apply_stacked_gradients,
                                              ops=CPU_KERNEL_OPS),
    supports=_all_cpu,
    priority=1,
    description="multi-threaded C++ kernels",
    installed=lambda: cpu_kernels_available(),  # the module's function, looked up when called
)
_REGISTRY: dict[str, EmbeddingBackend] = {"xla": XLA_BACKEND, "cpu": CPU_BACKEND}


def register_backend(backend: EmbeddingBackend) -> None:
  """Adds (or replaces) a backend under `backend.name`."""
  if not isinstance(backend, EmbeddingBackend):
    raise TypeError(f"register_backend takes an EmbeddingBackend, got {backend!r}.")
  if backend.name == "auto":
    raise ValueError("'auto' is reserved for automatic backend selection; choose another name.")
  _REGISTRY[backend.name] = backend


def registered_backends() -> tuple[str, ...]:
  """The names of every registered backend, installed or not."""
  return tuple(_REGISTRY)


def available_backends(plan: EmbeddingPlan | None = None) -> tuple[str, ...]:
  """The names of the registered backends that can run here.

  Without `plan`: those installed (the "cpu" backend only when its C++
  kernels were built and pass their probe). With `plan`: those installed
  that also support the plan, i.e. every name for which
  `get_backend(name, plan)` succeeds.
  """
  return tuple(name for name, backend in _REGISTRY.items()
               if backend.installed() and (plan is None or backend.supports(plan)))


def get_backend(name: str | EmbeddingBackend, plan: EmbeddingPlan) -> EmbeddingBackend:
  """The backend `name` (a registered name or an EmbeddingBackend value), or for
  "auto" the best registered one supporting `plan`.

  "auto" on CPU devices without the built C++ kernels warns once
  (`PortableCpuBackendWarning`) that the portable backend is slower.

  Raises:
    ValueError: an unknown name, a backend that is not installed here (see
      `available_backends`), or one that does not support `plan`.
  """
  if isinstance(name, EmbeddingBackend):
    backend = name
  elif name == "auto":
    chosen = next(
        (b for b in sorted(_REGISTRY.values(), key=lambda b: -b.priority)
         if b.installed() and b.supports(plan)),
        XLA_BACKEND,
    )
    if chosen.name == "xla" and _on_cpu(plan) and not _kernels_built():
      _warn_portable_on_cpu()
    return chosen
  elif name not in _REGISTRY:
    raise ValueError(f"unknown embedding backend {name!r}; registered: {sorted(_REGISTRY)}.")
  else:
    backend = _REGISTRY[name]
  if not backend.installed():
    if backend is CPU_BACKEND:
      built = "do not work with this jax/jaxlib" if _kernels_built() else "are not built"
      raise ValueError(
          f"embedding backend 'cpu' is not installed here: it needs the C++ CPU kernels, which"
          f" {built}. Reinstall the package from its source with a C++17 compiler available"
          " (`pip install -e .` in a checkout, or `pip install --force-reinstall --no-deps"
          " --no-binary sc-framework sc-framework`), or use backend='xla' (the portable ops,"
          " slower on CPU)."
      )
    raise ValueError(
        f"embedding backend {backend.name!r} is not installed here; installed:"
        f" {sorted(available_backends())}. Use backend='xla' (portable) or 'auto'."
    )
  if not backend.supports(plan):
    raise ValueError(
        f"embedding backend {backend.name!r} cannot run this plan on devices"
        f" {sorted({d.platform for d in plan.mesh.devices.flat})}; use backend='xla'."
    )
  return backend
