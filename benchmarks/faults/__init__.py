"""The data plane under failure: the fault run (writers and feed consumers while replicas,
Redis masters, a consumer and the network fail; its checker and mutants) and the lifecycle
run (memory bounded through a trainer kill and a route cache restart)."""
