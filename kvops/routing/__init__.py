"""Which engine a job goes to: the routing policy, the prefix index in Redis it reads, and the
tenants' cache salts."""
