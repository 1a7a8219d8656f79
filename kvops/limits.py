"""Input limits of the service (environment-tunable)."""
import os

# Characters, not tokens: the engine checks the token count against its model's limit.
MAX_PROMPT_CHARS = int(os.environ.get("KVOPS_MAX_PROMPT_CHARS", 200_000))
MAX_TOKENS = int(os.environ.get("KVOPS_MAX_TOKENS", 8192))
