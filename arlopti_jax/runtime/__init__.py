"""Below everything: the device mesh and sharding rules, multi-process start-up and collectives,
the persistent compilation cache, fault-injection sites, one-line start-up errors and the chip table."""
