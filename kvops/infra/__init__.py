"""What the processes stand on: `make run`'s launcher, the Celery broker's transport, files only
their owner may read."""
