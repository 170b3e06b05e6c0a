"""The I/O parts of ipcsync: endpoints and their service thread, the ZeroMQ channel, the
host (processes, /proc, credentials) and shared-memory naming.
"""
