"""The engine room: what turns submitted requests into executed collectives.

``core`` holds the engine every rank runs (queue, wake, in-flight table,
broken state, executor); ``rank_link`` is its side on ranks >= 1 (the link to
rank 0) and ``coordinator`` its side on rank 0 (negotiation, caches, deadlock
and stall detection). Adapters never import from here: they use the face of
``roundel.common`` (basics, collectives, objects, process sets, elastic,
compression).
"""
