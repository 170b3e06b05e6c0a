"""OS helpers, below the backends and the launcher: process identity and death (host),
the private runtime directory (paths), CPU segment names and the launcher's sweep
(shm), safe writes and reads (files), a call waited for a bounded time (bounded).
They load neither torch nor zmq, and nothing of ipcsync.runtime."""
