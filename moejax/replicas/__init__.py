"""Engine replicas (Ray actors) behind MoE-Prefill's frontend: the routing of requests to replicas (frontend), each
replica's serving of its shares, the run over them, and the watchdog over the processes a run starts."""
