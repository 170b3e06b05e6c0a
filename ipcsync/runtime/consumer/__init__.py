"""The consumer at run time: ConsumerEndpoint (endpoint) and its parts: the general
take (take), a release (release), the I/O toward the producer (upstream; its
handshake upstream_setup, its loss upstream_loss, what they use of it link_parts,
the producer's ring as this consumer sees it ring_memory), kept items (keeping),
foreign arenas and lending (foreign), verify=True (verify)."""
