"""Framework-independent core: runtime, engine, negotiation, settings and errors."""
