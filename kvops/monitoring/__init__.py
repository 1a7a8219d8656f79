"""/healthz (and vLLM's /health, /ping, /version), /metrics, and the latency histograms
kept in Redis."""
