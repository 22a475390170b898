"""Notices the user should see once per process (offline fallbacks, stale resolutions, ...).

They go to the `kernels` logger at WARNING level, so they show on stderr by default (Python's
last-resort handler) and can be silenced or redirected with the logging module.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("kernels")
_seen: set[str] = set()
_lock = threading.Lock()


def notice_once(key: str, message: str) -> bool:
    """Log `message` the first time `key` is seen in this process; True if it was logged."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    # Messages quote servers and metadata (names, reasons): escaped, line by line.
    from .safe_text import safe_lines  # only when a notice is shown

    logger.warning("\n".join(safe_lines(message)))
    return True


def reset() -> None:
    """Forget what was shown (for tests)."""
    with _lock:
        _seen.clear()
