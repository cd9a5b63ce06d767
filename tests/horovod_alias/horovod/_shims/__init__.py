"""Test-only stand-ins for Horovod internals that Horovod's test utilities import and roundel has no module for."""
