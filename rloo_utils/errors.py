"""Errors that end a run in one line: bad input (UsageError) and a run that cannot go on (RunError)."""

import signal


class UsageError(Exception):
    """Bad input: reported as a single line, without a traceback."""


class RunError(Exception):
    """A run that cannot go on (a checkpoint that cannot be written, training gone non-finite): one line, too."""


class NonFiniteWeights(RunError):
    """An optimizer step left an inf or NaN weight: the run stops, and RunGuard writes nothing of those weights.
    weights_finite looks at every shard on every process, so all of them raise it together (reported once)."""

    agreed = True


class Terminated(KeyboardInterrupt):
    """SIGTERM before training starts, or a second Ctrl-C or SIGTERM during training (the first lets the update finish,
    stop_after_update_on_signals): the run stops at once, as on Ctrl-C, and exits 128 + the signal, as a shell reports
    a process a signal ended (143 for SIGTERM, not Ctrl-C's 130)."""

    def __init__(self, signum: int = signal.SIGTERM, training: bool = False):
        super().__init__()
        self.signum, self.training = signum, training

    @staticmethod
    def handler(signum, frame):
        raise Terminated(signum)


def describe(e: BaseException) -> str:
    """`Type: first line of the message`, for error messages that must stay one line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
