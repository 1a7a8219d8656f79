"""The job stream: one ordered Redis stream of job updates from the workers, read by one hub
per web process."""
