"""The producer at run time: ProducerPort (port) and its parts: the pumps (inbound),
one consumer from HELLO to leaving (connections; who may: admission; from another
host: remote_join), the consumers by connection (peers), the arena (memory), the
handoff steps (slots; with handoff_types, slot_waits, reader_order, planner), sharing
by descriptor (sharing), zero-copy forwarding (forwarder), close (closing), asend's
wait (aio_slot), stats (stats)."""
