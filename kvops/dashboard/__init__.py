"""The live dashboard's web side: the websocket consumers and routes, the Origin check, what a
viewer may see of an engine's KV state, the KV timeline, a job's KV story as the API shows it."""
