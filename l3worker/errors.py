"""Errors the parent raises about its chip-children."""


class WorkerError(RuntimeError):
    """The worker cannot go on; close() it and make a new one."""


class ChildDiedError(WorkerError):
    pass


class ChildError(WorkerError):
    """A chip-child raised; the message carries its traceback text."""


class StepTimeoutError(WorkerError):
    pass
