"""Remote edges' I/O, gloo/NCCL groups on a sealed store: io (start here), groups,
completer, producer, consumer, sealed_store."""
