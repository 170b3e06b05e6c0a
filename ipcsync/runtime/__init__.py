"""The I/O parts of ipcsync. Here: what the two runtime endpoints share (endpoint,
waiting, aio, handover, telemetry); by job: transport/ (the ZeroMQ channel, the
lane), producer/ (ProducerPort and its parts), consumer/ (ConsumerEndpoint and its
parts), remote/ (edges between hosts). The OS helpers below them: ipcsync.system."""
