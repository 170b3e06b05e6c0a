"""Pure parts of ipcsync: no zmq, no /proc, no clock of their own (time is passed in).

protocol (codec and per-connection rules), ring (slot state machine), layout (how a
message lies in a slot), stats and rate-limited logging.
"""
