"""The control wire between the ranks' engines: the authenticated channel, its
typed messages and their codec, and the records that cross it (``records``).

It stands below the engine: nothing here imports more than the standard
library and roundel's ground modules. The engine room uses all of it; the face
of ``roundel.common`` only the records (to describe a collective it submits)."""
