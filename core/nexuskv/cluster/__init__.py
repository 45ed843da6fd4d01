"""This node in a cluster: its lease, its epoch (the fencing token), the heartbeat."""
