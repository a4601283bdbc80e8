"""The process of a `--direct_running_mode multi_processing` worker: Beam's own SDK harness
(`apache_beam.runners.worker.sdk_worker_main`) with its logging at the driver's level.

Beam starts each such worker as `python -m apache_beam.runners.worker.sdk_worker_main`, whose
stderr is the build's: importing Beam there logs "apitools not found ..." through the root
logger (which `logging.warning` configures on the spot) and the harness logs "Logging handler
created." at INFO before it reads any option. `shatter.pipeline.runners` starts this module instead, with
the driver's levels as its arguments (its root logger's and its "apache_beam" logger's): the
worker's loggers get the same levels and format, and Beam's import warning is dropped, as in the
driver (`shatter.pipeline.cli.configure_logging`).

Beam's logging client also prints straight to stderr ("Logging client failed: <a multi-line
gRPC error>... resetting") whenever the runner cancels its log stream: when the runner shuts
down, as after another worker died. That is not the cause of anything, and the driver reports
the cause in one line, so the worker's stderr drops it (`QuietStderr`).
"""

from __future__ import annotations

import logging
import sys


def configure(level: str, beam_level: str) -> None:
    from shatter.pipeline.cli import _DropBeamImportNoise

    logging.basicConfig(
        stream=sys.stderr, level=level, format="%(levelname)s %(name)s: %(message)s", force=True
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropBeamImportNoise())
    # the harness sets the root logger to INFO while it starts: Beam's own logger keeps the driver's
    logging.getLogger("apache_beam").setLevel(beam_level)


class QuietStderr:
    """`stream` without Beam's logging-client reconnect messages (module doc): `print` writes
    each as one string, then its newline, both dropped."""

    NOISE = "Logging client failed:"

    def __init__(self, stream):
        self.stream, self._dropped = stream, False

    def write(self, text: str) -> int:
        dropped, self._dropped = self._dropped, text.startswith(self.NOISE)
        if self._dropped or (dropped and text == "\n"):
            return len(text)
        return self.stream.write(text)

    def __getattr__(self, name):  # flush, fileno, isatty ...: the stream's own
        return getattr(self.stream, name)


def main() -> None:
    level, beam_level = (sys.argv[1:] + ["WARNING", "WARNING"])[:2]
    sys.stderr = QuietStderr(sys.stderr)
    configure(level, beam_level)
    from apache_beam.runners.worker import sdk_worker_main

    sdk_worker_main.main(sys.argv[:1])


if __name__ == "__main__":
    main()
