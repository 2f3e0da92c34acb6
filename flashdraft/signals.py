"""How a command ends on a signal: ``Stopped``, raised where the signal lands (a training loop
after its checkpoint, a benchmark, a judge's worker), turned into one line and exit status
128 + the signal by ``cli.entry``. A leaf: every part may raise it without importing another."""

from __future__ import annotations


class Stopped(BaseException):
    """A run stopped on a signal's request, after saving what it had: the command that ran it
    ends too, with exit status 128 + the signal's number and this message (cli.entry). A
    BaseException, like KeyboardInterrupt: a benchmark's handler raises it wherever the signal
    lands, and no ``except Exception`` (a bad record counted as a drop) may swallow it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
