"""Readable output by default: library warnings and errors once, plus our own lines.

MaxText, Orbax, JAX and absl log at INFO through Python's logging (MaxText's config dump alone is
~1,900 lines per run). By default those libraries show warnings and errors only, each distinct
message once per process, and hosts other than host 0 show errors only. Python warnings
(`warnings.warn`) go through the same filter. Our progress lines and summary are printed, so
they are unaffected. MaxText's `debug=true` brings every log back (nothing here runs).
"""

from __future__ import annotations

import logging


class Once(logging.Filter):
    """Passes each distinct (logger, level, message) once."""

    def __init__(self):
        super().__init__()
        self._seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


_ONCE = Once()


def quiet_library_logs(errors_only: bool = False) -> None:
    """Library logs at WARNING (ERROR when `errors_only`), each message once. Idempotent; a
    second call may raise the level (host 0 is known only once jax.distributed is up)."""
    from absl import logging as absl_logging

    level = logging.ERROR if errors_only else logging.WARNING
    absl_logging.set_verbosity(absl_logging.ERROR if errors_only else absl_logging.WARNING)
    root = logging.getLogger()
    root.setLevel(level)
    logging.captureWarnings(True)
    for handler in [*root.handlers, absl_logging.get_absl_handler()]:
        if _ONCE not in handler.filters:
            handler.addFilter(_ONCE)
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
