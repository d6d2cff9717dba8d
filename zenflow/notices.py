"""One-line notices for settings zenflow accepts but treats differently or not at all.

Each distinct message is logged once per process, so a config loaded in a loop does not flood.
"""

import logging

logger = logging.getLogger("zenflow")
_seen: set[str] = set()


def notice(message: str) -> None:
    if message in _seen:
        return
    _seen.add(message)
    logger.warning("zenflow: %s", message)


def reset_notices() -> None:
    """Forget what was said, so tests can check that a notice is given."""
    _seen.clear()
