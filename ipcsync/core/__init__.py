"""Pure parts of ipcsync: no zmq, no sockets, no /proc. The session and liveness rules
take the time as an argument (tested with a fake clock); only stats (rates, latencies)
and the rate-limited log read the monotonic clock themselves.

protocol (codec, message and error codes, the per-connection state machine),
producer_session / consumer_session (one connection's rules, frames in, events and frames
out), ring (slot state machine), layout (how a message lies in a slot; plan, layout-id
and recipe caches), liveness (the liveness rule as data), forwarding (the forwarding
ledger and foreign-arena registry), waits (the wait strategy of each ``wait=`` mode),
stats and ratelog.
"""
