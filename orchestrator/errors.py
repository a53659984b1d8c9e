"""The one exception hierarchy of mxload.

Every error mxload raises on purpose derives from :class:`MxloadError`. Each class
carries the CLI exit status it maps to (docs/contract.md §5): 2 for bad input or a refusal, 3 for a
plan that does not fit, 1 for a run that failed. Errors cross Ray process boundaries, so
they must pickle: every class takes one message string plus keyword context, and
``__reduce__`` rebuilds it from exactly that.

Messages say what and where: the file, the tensor, the key, the rank, the byte range, and
the setting to change. Context keywords (``file=``, ``tensor=``, ``key=``, ``rank=``,
``byte_range=``) are kept as attributes so that callers and tests can read them without
parsing text.
"""

from __future__ import annotations

from typing import Any


class MxloadError(Exception):
    """Base of every mxload error. ``exit_code`` is the CLI exit status."""

    exit_code: int = 1

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context: dict[str, Any] = dict(context)

    def __getattr__(self, name: str) -> Any:
        # Context fields read as attributes (err.file, err.tensor); only called when
        # normal lookup fails, so real attributes win.
        context = self.__dict__.get("context")
        if context is not None and name in context:
            return context[name]
        raise AttributeError(name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.context))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[MxloadError], message: str, context: dict[str, Any]) -> MxloadError:
    return cls(message, **context)


# --- exit status 2: bad input or a refusal -------------------------------------------


class InputError(MxloadError):
    """Bad input or a refusal: exit status 2."""

    exit_code = 2


class UsageError(InputError):
    """A flag or argument is wrong (names the flag)."""


class ConfigError(InputError):
    """config.json is unusable (names the key and the file)."""


class UnsupportedError(InputError, NotImplementedError):
    """A valid input mxload does not implement (per-tensor FP8, static activations...)."""


class CheckpointError(InputError):
    """The checkpoint's files disagree with each other or with the config."""


class HeaderError(CheckpointError):
    """A safetensors header is malformed or hostile (docs/contract.md §1.3). Names file and tensor."""


class HeaderTooLarge(HeaderError):
    """Declared header length exceeds the file size or the 100 MB cap."""


class TruncatedFile(HeaderError):
    """The file ends before its declared header or data."""


class InvalidHeaderJson(HeaderError):
    """The header is not valid UTF-8 JSON, or not an object of the expected shape."""


class UnknownDtype(HeaderError):
    """A tensor declares a dtype string mxload does not know."""


class InvalidShape(HeaderError):
    """A shape is not a list of non-negative ints, or its size overflows."""


class InvalidOffset(HeaderError):
    """data_offsets are malformed or point outside the data section."""


class SizeMismatch(HeaderError):
    """end - start differs from numel * itemsize."""


class OverlappingTensors(HeaderError):
    """Two tensors' byte ranges overlap."""


class InvalidTensorName(HeaderError):
    """A tensor name is empty or holds a control character or a path separator."""


class IndexError_(CheckpointError):
    """model.safetensors.index.json is malformed, or disagrees with the shards."""


class MissingTensor(CheckpointError):
    """A tensor the index (or the model) needs is absent from its file."""


class DuplicateTensor(CheckpointError):
    """A tensor is present in more than one file."""


class ScaleError(CheckpointError):
    """A quantized weight and its scale do not fit together."""


class UnpairedTensor(ScaleError):
    """A quantized weight without its scale, or a scale without its weight."""


class MismatchedScale(ScaleError):
    """A scale's shape is not (ceil(N/B_N), ceil(K/B_K)) (or (N, K/32) for MXFP8)."""


class NonFiniteScale(ScaleError):
    """A scale entry is NaN, Inf, zero or negative (names tensor and tile)."""


class MixedQuantization(CheckpointError):
    """Parts of one merged tensor disagree on being quantized."""


class OutputError(InputError):
    """An output path cannot take what mxload would write (a missing or read-only parent,
    a file where a folder goes, a non-empty folder without --overwrite, DST inside SRC, a
    full disk): names the path and the flag. Nothing the user had is changed."""


class LayoutError(InputError):
    """The model cannot take this parallel layout (says why)."""


class StagingBudgetError(InputError):
    """--staging-budget is below the minimum that can work (says the minimum)."""


class SessionError(InputError):
    """No such detached session, or it cannot be reached."""


class SessionBusy(SessionError):
    """Another command is reloading (or repairing) this session; names it (docs/contract.md §4)."""


class FencedOff(SessionError):
    """A command whose lease on its session lapsed (it was suspended past it) and was
    taken by a later one: nothing it wrote counts; names the command that took over
    (docs/contract.md §4 "Reload")."""


class ReloadMismatch(InputError):
    """A reload's checkpoint would not fill the session's buffers (lists every mismatch)."""


class AdoptionError(InputError):
    """Buffers handed to a loader do not match the plan (shape, dtype, device, contiguity)."""


# --- exit status 3: does not fit -------------------------------------------------------


class PlanDoesNotFit(MxloadError):
    """The plan needs more device memory than --device-memory allows."""

    exit_code = 3


# --- exit status 1: a run that failed --------------------------------------------------


class RunError(MxloadError):
    """A run failed part-way: storage gone, a worker lost, an address moved."""

    exit_code = 1


class StorageError(RunError):
    """A read failed for good (after retries, or a non-retryable error)."""


class WorkerLost(RunError):
    """A worker process died and could not be restarted within its budget."""


class HeadDown(RunError):
    """The Ray head a detached session was recorded on is dead or half-dead (says which of
    its processes died)."""


class HeadStopped(RunError):
    """The Ray head a detached session was recorded on is alive but stopped (its GCS or
    raylet is in the stopped state: SIGSTOP, a debugger): Ray would wait on it for
    minutes. It is not down: resumed, it still holds its sessions."""


class AddressMoved(RunError):
    """A persistent buffer's data_ptr changed: a captured graph would be invalid."""


class ConversionError(RunError):
    """A unit could not be converted (names rank and tensor)."""


class NumericsError(ConversionError, ValueError):
    """A numerics function got an input it cannot take (shape, dtype, a K not a multiple
    of 32). A caller bug rather than bad user input, so it is a ConversionError; it is
    also a ValueError so code written against plain ``ValueError`` still catches it."""
