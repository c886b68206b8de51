"""Native (C++) log lines on the process's stderr, filtered by message.

TVM logs through C++ ``LOG(WARNING)`` straight to file descriptor 2, which Python's
:mod:`warnings` filters never see. :func:`dropped_native_lines` catches what is written
to that descriptor inside a block and writes every line back afterwards, except the
lines that contain one of the messages the caller knows to be expected.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# One thread at a time may move file descriptor 2; the same thread may nest blocks.
_REDIRECT = threading.RLock()


@contextmanager
def dropped_native_lines(*messages: str) -> Iterator[None]:
    """Inside the block, stderr (file descriptor 2, Python's ``sys.stderr`` included)
    goes to a temporary file; on leaving it, each line (bytes, undecoded) that contains
    none of ``messages`` is written to the real stderr, in order, and the rest dropped.

    Other threads that write to stderr meanwhile are delayed, never dropped unless a
    line matches. A process that dies inside the block loses what it wrote there."""
    needles = [m.encode() for m in messages]
    with _REDIRECT, tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        real = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(real, 2)
            os.close(real)
            captured.seek(0)
            for line in captured:
                if not any(n in line for n in needles):
                    os.write(2, line)
