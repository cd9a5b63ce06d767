"""The ``roundelrun`` launcher: host slots, rendezvous store, worker processes.

Modules: ``hosts`` (parsing and slot assignment), ``rendezvous`` (the
authenticated key-value store), ``spawn`` (starting workers and relaying
their output) and ``launch`` (the command line). Nothing here imports a
deep-learning framework, so the launcher starts quickly.
"""
