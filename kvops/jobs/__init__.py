"""A job's life after intake: admission (idempotency, caps, group commit), the job store, the
outbox, the reaper, the deadline, and one job followed from a web process."""
