"""The ``roundelrun`` launcher: host slots, rendezvous store, worker processes.

Modules: ``launch`` (the command line) with ``flags`` and ``config``,
``hosts`` (parsing and slot assignment), ``worker`` (the interface the
launcher supervises a worker through), ``spawn`` (starting worker processes
and relaying their output), ``remote`` (the worker's end of ssh),
``elastic_driver`` and ``discovery`` (elastic jobs), ``outcome`` (what a
rank's function did, for ``roundel.run``, Ray and Spark) and ``run_api``
(``roundel.run``). Its rendezvous store is ``roundel.rendezvous.store``. No
worker needs this package, and nothing here imports a deep-learning
framework, so the launcher starts quickly.
"""
