"""Errors the parent raises about its chip-children and its engine."""


class WorkerError(RuntimeError):
    """The worker cannot go on; close() it and make a new one."""


class ChildFailure(WorkerError):
    """A chip-child died, raised or hung: the engine restarts its children (within max_restarts)."""


class ChildDiedError(ChildFailure):
    pass


class ChildError(ChildFailure):
    """A chip-child raised; the message carries its traceback text."""


class StepTimeoutError(ChildFailure):
    pass


class StoppingError(WorkerError):
    """The engine was told to stop while it waited on its children (shutdown)."""


class EngineBusyError(WorkerError):
    """More requests wait than max_waiting_requests allows; the request was not queued."""


class EngineAsleepError(EngineBusyError):
    """The engine sleeps (sleep()), or its weights were dropped and not updated yet: it takes no
    request until wake_up() (and a weight update)."""


class RequestFailedError(WorkerError):
    """The request was in flight at two consecutive chip-child failures and was failed alone."""
