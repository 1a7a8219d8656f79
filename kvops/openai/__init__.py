"""The OpenAI-compatible API (/v1) and vLLM's /tokenize and /detokenize: its handler, auth,
errors, completions and chat, server-sent events, the Responses API."""
