"""How frames and memory travel: the ZeroMQ channel (channel: its names; address,
curve, zap, socket_channel, producer_channel, consumer_channel, bindlock) and a
same-host edge's lane (lane) with its packet of descriptors (memory_wire)."""
