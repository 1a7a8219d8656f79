"""What operators do to engines: actions sent to a worker, moving requests between engines
and drains, all recorded in the chained operator log."""
