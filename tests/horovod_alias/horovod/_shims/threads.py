"""``horovod.runner.util.threads.in_thread`` (imported by Horovod's ``test/utils/common.py``)."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Start ``target(*args)`` in a new thread and return the thread; ``silent`` swallows its exceptions."""
    def run():
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread
