"""Many nodes: the head's node table and how a driver sees the cluster."""
