"""Moving a running request's KV between engines: the migrator, its port, tickets and checks."""
