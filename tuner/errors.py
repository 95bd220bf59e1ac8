"""Every error the tuner raises on purpose.

    TunerError
    ├── ModelError                 the GGUF file cannot be used
    │   ├── ModelNotFoundError     no such file, or a directory
    │   ├── NotGGUFError           the file is not GGUF (bad magic)
    │   ├── TruncatedGGUFError     the header or tensor data run past the end of the file
    │   ├── EmptyModelError        a GGUF without tensors
    │   ├── UnsupportedArchitectureError  the sizing arithmetic lacks a key it needs
    │   └── RemoteModelError       a model's URL cannot be read (HTTP error, no range support, timeout)
    ├── SettingsError              a candidate setting is invalid (before any launch)
    ├── RunnerError                the trial machinery itself failed (not a trial outcome)
    ├── EngineError                an engine cannot be used (no llama.cpp binaries there, one that
    │                              does not start, a build without a feature asked of it)
    ├── RPCError                   an RPC server could not be started or reached
    ├── StudyError                 the tune loop cannot go on (e.g. no candidate fits)
    ├── QualityError               quality cannot be measured (no corpus, a corpus too short, ...)
    ├── QuantizeError              a quantization variant cannot be made (requantizing, no disk, ...)
    ├── MachineSpecError           a described machine (--device, --ram, --machine FILE) cannot be read
    ├── LogUnreadableError         a llama.cpp log holds nothing that says what happened at load
    ├── FileWriteError             a file the tuner writes cannot be written (read-only, full disk)
    ├── ReportError                a report cannot be made (no such study or profile, PNG export failed)
    ├── StorageError               a study store or profile registry database cannot be opened or used
    ├── MachineBusyError           another tuner is measuring on this machine (and we were told not to wait)
    └── ProfileError               a profile cannot be used
        ├── ProfileValidationError a field is wrong (dotted path in the message)
        ├── SchemaVersionError     a profile of an unknown major schema version
        ├── NoMatchingProfileError no profile for this model on this machine
        └── ProfileMismatchError   the profile does not fit this model file / this machine now

Trial outcomes (oom, crash, timeout, ...) are not exceptions: see ``tuner.engine.outcome``.
"""

from __future__ import annotations


class TunerError(Exception):
    """Root of every error the tuner raises on purpose."""


class ModelError(TunerError):
    """The model file cannot be used. The message names the file and the problem."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ModelNotFoundError(ModelError):
    pass


class NotGGUFError(ModelError):
    pass


class TruncatedGGUFError(ModelError):
    pass


class EmptyModelError(ModelError):
    pass


class UnsupportedArchitectureError(ModelError):
    pass


class RemoteModelError(ModelError):
    """A model's URL cannot be read: an HTTP error, a server without range requests, a timeout."""


class SettingsError(TunerError, ValueError):
    """A candidate setting is invalid. ``field`` is a dotted path to it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class RunnerError(TunerError):
    pass


class EngineError(TunerError):
    """An engine cannot be used: the message names the binaries or library and what to do."""


class RPCError(TunerError):
    """``reason`` is what the server's failure was in itself (``cannot connect to ...``), without
    the endpoint and the advice the message adds; a probe lists it next to the endpoint."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason if reason is not None else message


class StudyError(TunerError):
    pass


class QualityError(TunerError):
    """Quality cannot be measured: the corpus is missing, not UTF-8 or too short, the engine cannot
    score text, or llama.cpp failed while scoring. The message says what to change."""


class QuantizeError(TunerError):
    """A quantization variant cannot be made: an unknown type, an already-quantized source without
    ``allow_requantize``, too little free disk, or llama.cpp's quantizer failed."""


class FileWriteError(TunerError):
    """A file the tuner writes (a profile, a bundle, the study database's folder) cannot be written:
    a read-only or full disk, a folder in the way. ``path`` and ``reason`` (the system's words)."""

    def __init__(self, path: object, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot write {self.path}: {reason}")
class ReportError(TunerError):
    pass


class StorageError(TunerError):
    """A database (``--storage``, a registry URL) cannot be used: not a URL, no driver, unreachable,
    damaged. The message names it, without credentials, and says what to do."""


class MachineBusyError(TunerError):
    """Another tuner holds this machine's measurement lock."""


class ProfileError(TunerError):
    pass


class ProfileValidationError(ProfileError, ValueError):
    """A profile field is wrong. ``field`` is its dotted path, e.g. ``settings.tensor_split[1]``."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class SchemaVersionError(ProfileError):
    pass


class NoMatchingProfileError(ProfileError):
    pass


class ProfileMismatchError(ProfileError):
    pass


class MachineSpecError(TunerError):
    """A described machine (``--device NAME=SIZE``, ``--ram``, ``--machine FILE``) cannot be read."""


class LogUnreadableError(TunerError):
    """A log holds none of the lines that say what happened at load; the message says what was missing."""
