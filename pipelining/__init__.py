"""The Trainer: fit / evaluate / predict with pipelined embedding lookups."""

from pipelining._callbacks import Callback
from pipelining._config import TrainerConfig
from pipelining._data import DataStream
from pipelining._determinism import NondeterministicResumeWarning
from pipelining._distributed import (
    DistributedError,
    DistributedJob,
    allgather_json,
    barrier,
    check_agreement,
    initialize_distributed,
    resolve_job_settings,
)
from pipelining._metrics import roc_auc
from pipelining._prefetch import Prefetcher
from pipelining._steps import DeviceBatch, InFlight, StepFunctions, TrainState
from pipelining._fit_loop import History, NonFiniteLossError
from pipelining._trainer import Trainer

__all__ = [
    "Trainer",
    "TrainerConfig",
    "History",
    "Callback",
    "NonFiniteLossError",
    "NondeterministicResumeWarning",
    "TrainState",
    "DeviceBatch",
    "InFlight",
    "StepFunctions",
    "DataStream",
    "Prefetcher",
    "roc_auc",
    "initialize_distributed",
    "resolve_job_settings",
    "DistributedJob",
    "DistributedError",
    "barrier",
    "check_agreement",
    "allgather_json",
]
