"""Transports that move tensor data: a Backend interface and its implementations."""
