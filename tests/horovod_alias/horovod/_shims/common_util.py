"""Stand-in for ``horovod.common.util``'s ``env`` (Horovod's test utilities set variables with it)."""

import contextlib
import os


@contextlib.contextmanager
def env(**kwargs):
    """Set the environment variables ``kwargs`` for the duration of the block, then restore them."""
    saved = {name: os.environ.get(name) for name in kwargs}
    os.environ.update({name: str(value) for name, value in kwargs.items()})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
