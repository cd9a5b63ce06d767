"""The control wire between the ranks' engines: the authenticated channel, its
typed messages and their codec. Only the engine room uses it."""
