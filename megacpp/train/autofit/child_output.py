"""A child process's output, shown as it comes and kept: its terminal, a log file, and a tail.

The supervisor runs the training in a child whose stdout and stderr are pipes. A thread per pipe
copies each chunk at once to the supervisor's own stream (progress bars keep working: ``\\r`` updates
pass through unchanged) and writes the finished lines to the attempt's log file in the run directory,
where a progress bar's ``\\r`` redraws are collapsed to their last state so a long run's log stays
small. The last lines of both streams are kept so that a failed child's end can be printed again:
a crash is never invisible, whoever reads only the supervisor's last lines.
"""
from __future__ import annotations

import codecs
import io
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, BinaryIO

TAIL_LINES = 40


class _LineCollector:
    """Decodes one stream's bytes into finished lines; a line redrawn with ``\\r`` keeps its last draw."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def feed(self, data: bytes) -> list[str]:
        self._pending += self._decoder.decode(data)
        *lines, self._pending = self._pending.split("\n")
        return [_last_draw(line) for line in lines]

    def finish(self) -> list[str]:
        rest = _last_draw(self._pending + self._decoder.decode(b"", final=True))
        self._pending = ""
        return [rest] if rest else []


def _last_draw(line: str) -> str:
    """What a terminal shows of a line drawn over with carriage returns (a trailing one is ignored)."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


class ChildOutput:
    """Copies a child's two pipes to `stdout`/`stderr` and into `log_path` (appended), keeping a tail."""

    def __init__(self, pipes: tuple[BinaryIO, BinaryIO], sinks: tuple[IO, IO], log_path: Path,
                 header: str) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = log_path.open("a", encoding="utf-8")
        self._log.write(header.rstrip("\n") + "\n")
        self._log.flush()
        self._lock = threading.Lock()
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._threads = [threading.Thread(target=self._pump, args=(pipe, sink), daemon=True,
                                          name=f"megacpp-child-output-{i}")
                         for i, (pipe, sink) in enumerate(zip(pipes, sinks, strict=True))]
        for thread in self._threads:
            thread.start()

    def _pump(self, pipe: BinaryIO, sink: IO) -> None:
        lines = _LineCollector()
        fd = pipe.fileno()
        while chunk := os.read(fd, 1 << 16):
            _write(sink, chunk)
            self._keep(lines.feed(chunk))
        self._keep(lines.finish())
        pipe.close()

    def _keep(self, lines: list[str]) -> None:
        if not lines:
            return
        with self._lock:
            self._log.write("".join(f"{line}\n" for line in lines))
            self._log.flush()
            self._tail.extend(lines)

    def close(self, epilogue: str = "", timeout_s: float = 10.0) -> None:
        """Wait until both pipes are drained: every byte the child wrote is shown and logged, then
        `epilogue` (the supervisor's own last word on the attempt) is logged below it. A pipe still held
        open by a process that escaped the child's process group is abandoned after `timeout_s` (its
        daemon thread keeps copying)."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if epilogue:
            self._keep([epilogue])
        if not any(thread.is_alive() for thread in self._threads):
            self._log.close()

    def tail(self) -> list[str]:
        with self._lock:
            return list(self._tail)


def _write(sink: IO, chunk: bytes) -> None:
    """The bytes as they are; to a text stream through its binary buffer when it has one (after what the
    supervisor itself printed there), else decoded."""
    if isinstance(sink, io.TextIOBase):
        sink.flush()
        buffer = getattr(sink, "buffer", None)
        if buffer is None:
            sink.write(chunk.decode("utf-8", errors="replace"))
            sink.flush()
            return
        sink = buffer
    sink.write(chunk)
    sink.flush()
