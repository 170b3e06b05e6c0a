"""The I/O parts of ipcsync: endpoints and their service thread, the ZeroMQ channel, the
host (processes, /proc, credentials), the runtime directory (paths) and
shared-memory naming (shm). paths and shm load neither torch nor zmq: the launcher uses them.
"""
