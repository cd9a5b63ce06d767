"""The framework-neutral core: collectives API, runtime (init, ranks, process sets), engine, negotiation, settings, elastic state."""
