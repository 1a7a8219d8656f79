"""What the engine shows: the KV view and feed, snapshots, KV stories, vLLM-format KV events."""
